# shellcheck shell=bash
# Shared helpers of the CI scripts (sourced, not run). Plain bash + awk,
# and a Go program for the test logs and coverage profiles (build_ci_tool):
# nothing to install on a fresh Debian machine but Go.

# The CI's own directory, and the file of the skips allowed there.
ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ci_skips=$ci_dir/skips

# etcd_server_deps PKG: the etcd server packages among PKG's dependencies,
# one a line; nothing if none. Fails if go list fails. The whole list is
# read before it is matched: with `go list | grep -q` under pipefail, grep
# quitting at the first match kills go list (SIGPIPE), and the pipeline's
# failure reads as "not found".
etcd_server_deps() {
	local deps
	deps=$(go list -deps "$1") || return
	awk '/^go\.etcd\.io\/etcd\/server(\/|$)/' <<< "$deps"
}

# browser_path: the path of the browser the browser test (TestUIBrowser,
# cmd/coord) runs, as it looks for one: $COORD_TEST_BROWSER, else the first
# of these on the PATH; nothing if none.
browser_path() {
	if [ -n "${COORD_TEST_BROWSER:-}" ]; then echo "$COORD_TEST_BROWSER"; return; fi
	local name
	for name in chromium chromium-browser google-chrome google-chrome-stable headless-shell; do
		if command -v "$name"; then return; fi
	done
}

# install_browser: installs Debian's chromium with apt unless a browser is
# there already (GitHub's Ubuntu runners have Google Chrome). Root or
# passwordless sudo. The browser test fails CI without one: its skip is
# not declared in .ci/skips.
install_browser() {
	local found
	found=$(browser_path)
	if [ -n "$found" ]; then
		echo "browser for the browser test: $found"
		return 0
	fi
	echo "installing chromium (the browser test's)"
	apt_install chromium
	found=$(browser_path)
	if [ -z "$found" ]; then
		echo "no browser after installing chromium" >&2
		return 1
	fi
	echo "browser for the browser test: $found"
}

# apt_install [-t RELEASE] PKG...: installs Debian packages with apt, from
# RELEASE if given (e.g. bookworm-backports; its source is added if the
# system has none). Root or passwordless sudo. Quiet: only errors, less
# debconf's notice that apt-utils is missing.
apt_install() {
	local sudo='' target=()
	if [ "$(id -u)" != 0 ]; then sudo="sudo -n"; fi
	if [ "${1:-}" = -t ]; then
		target=(-t "$2")
		if ! grep -rqs "$2" /etc/apt/sources.list /etc/apt/sources.list.d/; then
			printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$2" |
				$sudo tee "/etc/apt/sources.list.d/$2.sources" > /dev/null
		fi
		shift 2
	fi
	$sudo apt-get update -qq
	$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		"${target[@]}" "$@" 2>&1 > /dev/null |
		{ grep -v '^debconf: delaying package configuration' >&2 || true; }
}

# qemu_release: the Debian release to take qemu-user-static from: on
# Debian 12 (bookworm), bookworm-backports (qemu 10), as its own qemu 7.2
# cannot run etcd on loong64 (see .ci/cross's probe); elsewhere nothing
# (the system's own).
qemu_release() {
	if [ -r /etc/os-release ] && [ "$(. /etc/os-release && echo "${ID:-}-${VERSION_CODENAME:-}")" = debian-bookworm ]; then
		echo bookworm-backports
	fi
}

# The targets .ci/cross runs by default, in this order. riscv64 last: the
# slowest under emulation, its shard and command tests missed their
# deadlines in a cold run while the next target compiled beside them
# (even at nice 19); last, nothing compiles then.
cross_targets=(arm64 ppc64le s390x loong64 riscv64)

# qemu_cpu GOARCH: the name of the qemu user-mode emulator's CPU.
qemu_cpu() {
	case $1 in
	arm64) echo aarch64 ;;
	loong64) echo loongarch64 ;;
	ppc64le | s390x | riscv64) echo "$1" ;;
	*) echo "cross: no emulator known for GOARCH=$1" >&2; return 1 ;;
	esac
}

# prebuild GOARCH LOG: compiles GOARCH's test binaries into the build
# cache as .ci/cross's run builds them (coverage on), at the lowest CPU
# priority, and runs none of them (-exec true): the run then only links.
# On a cold build cache that is the etcd server and its dependencies,
# about a minute and a half of CPU per GOARCH. Output in LOG; a failure is
# the run's to report.
prebuild() {
	CGO_ENABLED=0 GOARCH=$1 nice -n 19 go test -count=1 -cover -run '^$' -exec true ./... > "$2" 2>&1
}

# The `go test -json` logs, the coverage profiles and the declared skips
# are read by a Go program, .ci/report (its own module, standard library
# only): the functions below call it. build_ci_tool builds it once, for the
# host whatever GOOS, GOARCH or CGO_ENABLED say (the cross stage sets them
# for go test), into a temporary directory, and exports its path as
# COORD_CI_REPORT, which the scripts run from this one reuse; ci_cleanup
# removes it again if this shell built it (call it on exit).
build_ci_tool() {
	if [ -n "${COORD_CI_REPORT:-}" ] && [ -x "$COORD_CI_REPORT" ]; then return 0; fi
	ci_tool_dir=$(mktemp -d "${TMPDIR:-/tmp}/coord-ci-report.XXXXXX") || return
	if ! (cd "$ci_dir/report" &&
		GOOS=$(go env GOHOSTOS) GOARCH=$(go env GOHOSTARCH) CGO_ENABLED=0 GOFLAGS='' GOWORK=off \
			go build -buildvcs=false -o "$ci_tool_dir/report" .); then
		echo "cannot build the CI's report program ($ci_dir/report)" >&2
		ci_cleanup
		return 1
	fi
	export COORD_CI_REPORT=$ci_tool_dir/report
}

ci_cleanup() {
	if [ -n "${ci_tool_dir:-}" ]; then rm -rf "$ci_tool_dir"; fi
	ci_tool_dir=''
}

# ci_tool SUBCOMMAND ARGS...: runs the report program (see build_ci_tool).
ci_tool() {
	"${COORD_CI_REPORT:?the report program is not built: call build_ci_tool first}" "$@"
}

# coverage_stats PROFILE: the statement coverage of package coord's own
# files (not coordtest, not cmd) in a -coverprofile, as "PERCENT COVERED
# TOTAL" (statements). A block counts once however often it appears (the
# profiles of several test binaries merged), as run if any of its lines
# has a count above 0. PERCENT is truncated to one decimal: 100.0 only
# when no statement is missed.
coverage_stats() { ci_tool coverage "$1"; }

# missed_blocks PROFILE [MAX]: the blocks of statements of package coord's
# own files that no test ran, in the profile's order, one a line:
# "FILE:START,END: N statements"; past MAX (default 100), how many more.
missed_blocks() { ci_tool missed "$1" "${2:-100}"; }

# check_skips [FILE]: true if every line of the declared skips (default
# .ci/skips) is blank, a # comment, or a test name followed by its reason;
# else prints the bad lines.
check_skips() {
	local f=${1:-$ci_skips}
	[ -e "$f" ] || return 0
	ci_tool checkskips "$f"
}

# skipped_tests LOG [SKIPS]: the tests, subtests and examples of a
# `go test -json` log that were skipped, one a line, tab-separated:
#   declared|undeclared  TEST  PACKAGE  REASON
# declared if TEST (as go test names it: TestX, TestX/sub) is in SKIPS
# (default .ci/skips); REASON is the test's last line of output (t.Skip's).
skipped_tests() { ci_tool skips "$1" "${2:-$ci_skips}"; }

# count_tests ACTION LOG: how many tests, subtests and examples of a
# `go test -json` log ended with ACTION (pass or skip); for fail, also
# those that never ended (their binary crashed or timed out).
count_tests() { ci_tool count "$1" "$2"; }

# json_text [LOG]: turns a `go test -json` stream (file or stdin) back into
# what `go test` without -v prints: package result lines, anything printed
# outside a test (build errors, panics, TestMain's goleak report), and the
# output of each test that fails or never ends (a crash, a timeout: its
# first and last 40 lines). Streams, flushing each line.
json_text() { ci_tool text "${1:--}"; }

# result_row TARGET LOG PROFILE SECONDS RC: one tab-separated result line,
#   target  passed  failed  skipped  coverage  seconds  status
# LOG is the `go test -json` output, PROFILE the -coverprofile (empty: no
# coverage, no gate), RC go test's exit status. status is ok, FAIL (go test
# failed), or else GATE (package coord misses the coverage gate:
# ${COVERAGE_GATE:-100} at 100 or above, no statement missed; below, at
# least that percentage, unrounded; no statement at all fails), SKIP (a
# test skipped that .ci/skips does not declare), or GATE+SKIP.
result_row() { ci_tool row "$1" "$2" "$3" "$4" "$5" "$ci_skips"; }

# run_report LOG PROFILE: what a result row sums up, in words: the coverage
# of package coord and the blocks no test ran (PROFILE empty: no coverage),
# the tests skipped, and those of them that .ci/skips does not declare,
# with the reason each gave.
run_report() { ci_tool report "$1" "$2" "$ci_skips"; }

# fmt_secs N: N seconds as "MmSSs".
fmt_secs() { printf '%dm%02ds' $(( $1 / 60 )) $(( $1 % 60 )); }

# print_table ROWFILE...: the result table, one line per row file. A
# missing or empty row file (its run died) is shown as a failure.
print_table() {
	local f target passed failed skipped pct secs status cov
	printf '%-16s %7s %7s %7s %9s %8s  %s\n' TARGET PASSED FAILED SKIPPED COVERAGE WALL STATUS
	for f in "$@"; do
		if [ -s "$f" ]; then
			IFS=$'\t' read -r target passed failed skipped pct secs status < "$f"
		else
			target=$(basename "$f" .row) passed='?' failed='?' skipped='?' pct=- secs=0 status=FAIL
		fi
		cov=$pct; [ "$pct" = - ] || cov="$pct%"
		printf '%-16s %7s %7s %7s %9s %8s  %s\n' "$target" "$passed" "$failed" "$skipped" "$cov" "$(fmt_secs "$secs")" "$status"
	done
}

# row_status ROWFILE: the status of a row; FAIL if there is none.
row_status() {
	if [ -s "$1" ]; then awk -F'\t' '{ print $NF; exit }' "$1"; else echo FAIL; fi
}

# rows_ok ROWFILE...: true if every row says ok.
rows_ok() {
	local f
	for f in "$@"; do
		[ "$(row_status "$f")" = ok ] || return 1
	done
}
