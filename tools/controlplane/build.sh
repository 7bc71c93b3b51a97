#!/bin/sh
# Builds the control plane's binaries (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler) at the versions go.mod pins, the job controllers (Kueue, the
# training-operator, the Trainer, JobSet) and helm (which renders and lints deploy/helm)
# at the versions their own modules pin (each its own: their Kubernetes libraries are
# not kube-apiserver's), from the Go module proxy, into a cache outside the repository keyed by
# component and version, so a machine builds each once:
#   $JITCKPT_CONTROLPLANE_CACHE/<component>-<version>/<component>
# (default /var/cache/jitckpt/controlplane). A version already there is not rebuilt.
# The build runs at the lowest priority, one package at a time: kube-apiserver is
# minutes of compiling that would otherwise starve whatever else the machine runs.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
cache=${JITCKPT_CONTROLPLANE_CACHE:-/var/cache/jitckpt/controlplane}
GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
# readonly: a build never rewrites go.mod or go.sum; local: the Go installed, never a download.
export GOFLAGS="-mod=readonly -buildvcs=false" GOTOOLCHAIN=local
cd "$here"

# The version ${2:-go.mod} requires of module $1, read without Go: a built cache needs none.
version_of() {
	awk -v m="$1" '$1 == m { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "${2:-go.mod}"
}

# build COMPONENT VERSION PACKAGE [LDFLAGS]
build() {
	dest="$cache/$1-$2"
	if [ -x "$dest/$1" ]; then
		return 0
	fi
	echo "building $1 $2 into $dest (once per machine; minutes)" >&2
	mkdir -p "$dest"
	# Written beside its place and renamed: an interrupted build leaves no binary
	# that a later run would take for a finished one.
	nice -n 19 "$GO" build -p 1 -trimpath -ldflags "-s -w ${4:-}" -o "$dest/$1.partial" "$3"
	mv "$dest/$1.partial" "$dest/$1"
}

etcd=$(version_of go.etcd.io/etcd/server/v3)
kube=$(version_of k8s.io/kubernetes)
build etcd "$etcd" go.etcd.io/etcd/server/v3
# The version the binary reports (/version): a build as a dependency stamps none.
minor=$(echo "$kube" | cut -d. -f2)
stamp=k8s.io/component-base/version
version="-X $stamp.gitVersion=$kube -X $stamp.gitMajor=1 -X $stamp.gitMinor=$minor -X $stamp.gitTreeState=clean"
for component in kube-apiserver kube-controller-manager kube-scheduler; do
	build "$component" "$kube" "k8s.io/kubernetes/cmd/$component" "$version"
done
helm=$(version_of helm.sh/helm/v3 helm/go.mod)
(cd helm && build helm "$helm" helm.sh/helm/v3/cmd/helm "-X helm.sh/helm/v3/internal/version.version=$helm")

# manifests COMPONENT VERSION MODULE DIR...: the module's own YAML (its CRDs, RBAC and
# webhook configurations), copied beside the binary so the cluster applies them with
# no Go and no module cache; copied before the binary, whose presence marks it done.
manifests() {
	dest="$cache/$1-$2"
	if [ -x "$dest/$1" ]; then
		return 0
	fi
	# download, not list: on a new machine the module is not in the cache yet
	src=$("$GO" mod download -json "$3" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
	shift 3
	mkdir -p "$dest/manifests"
	for dir in "$@"; do
		mkdir -p "$dest/manifests/$dir"
		cp "$src/$dir"/*.yaml "$dest/manifests/$dir/"
	done
}

# Kueue, the Kubeflow training-operator (PyTorchJob v1), and the Kubeflow Trainer (TrainJob,
# v2) with the JobSet controller it creates JobSets for: modules of their own, each with
# the Kubernetes libraries its upstream go.mod requires.
kueue=$(version_of sigs.k8s.io/kueue kueue/go.mod)
(cd kueue && manifests kueue "$kueue" sigs.k8s.io/kueue \
	config/components/crd/bases config/components/webhook config/components/rbac &&
	build kueue "$kueue" sigs.k8s.io/kueue/cmd/kueue \
		"-X sigs.k8s.io/kueue/pkg/version.GitVersion=$kueue")
operator=$(version_of github.com/kubeflow/training-operator training-operator/go.mod)
(cd training-operator && manifests training-operator "$operator" \
	github.com/kubeflow/training-operator manifests/base/crds manifests/base/rbac \
		manifests/base/webhook &&
	build training-operator "$operator" \
		github.com/kubeflow/training-operator/cmd/training-operator.v1)
trainer=$(version_of github.com/kubeflow/trainer/v2 trainer/go.mod)
(cd trainer && manifests trainer "$trainer" github.com/kubeflow/trainer/v2 \
	manifests/base/crds manifests/base/webhook manifests/base/runtimes manifests/base/rbac &&
	build trainer "$trainer" github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager)
jobset=$(version_of sigs.k8s.io/jobset jobset/go.mod)
(cd jobset && manifests jobset "$jobset" sigs.k8s.io/jobset config/components/crd/bases \
	config/components/webhook config/components/webhook/patches config/components/rbac &&
	build jobset "$jobset" sigs.k8s.io/jobset \
		"-X sigs.k8s.io/jobset/pkg/version.GitVersion=$jobset")
