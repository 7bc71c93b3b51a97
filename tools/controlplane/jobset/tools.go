//go:build tools

// Package tools only names what this module builds, so that go.mod keeps it required.
package tools

import _ "sigs.k8s.io/jobset"
