//go:build tools

// Package tools only names what this module builds, so that go.mod keeps it required.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
