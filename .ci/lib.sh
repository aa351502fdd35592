# shellcheck shell=bash
# Shared helpers of the CI scripts (sourced, not run). Plain bash + awk:
# nothing to install on a fresh Debian machine.

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

# coverage_stats PROFILE: the statement coverage of package coord's own
# files (not coordtest, not cmd) in a -coverprofile, as "PERCENT COVERED
# TOTAL" (statements). A block counts once however often it appears (the
# profiles of several test binaries merged), as run if any of its lines
# has a count above 0. PERCENT is truncated to one decimal: 100.0 only
# when no statement is missed.
coverage_stats() { coverage_awk stats "$1"; }

# missed_blocks PROFILE [MAX]: the blocks of statements of package coord's
# own files that no test ran, in the profile's order, one a line:
# "FILE:START,END: N statements"; past MAX (default 100), how many more.
missed_blocks() { coverage_awk missed "$1" "${2:-100}"; }

coverage_awk() {
	awk -v what="$1" -v max="${3:-0}" '
		/^mode:/ { next }
		# FILE:LINE.COL,LINE.COL STATEMENTS COUNT
		NF == 3 && match($1, /:[0-9]+\.[0-9]+,[0-9]+\.[0-9]+$/) {
			file = substr($1, 1, RSTART - 1)
			if (file !~ /^github\.com\/go-coord\/coord\/[^\/]+\.go$/) next
			if (!($1 in stmts)) { order[++nblocks] = $1; stmts[$1] = $2 + 0; count[$1] = 0 }
			if ($3 + 0 > count[$1]) count[$1] = $3 + 0
		}
		END {
			for (i = 1; i <= nblocks; i++) {
				b = order[i]; total += stmts[b]
				if (count[b] > 0) covered += stmts[b]
				else if (what == "missed" && stmts[b] > 0 && ++nmissed <= max) printf "%s: %d statement%s\n", b, stmts[b], stmts[b] == 1 ? "" : "s"
			}
			if (nmissed > max) printf "... and %d more blocks\n", nmissed - max
			if (what == "stats") {
				if (total == 0) print "0.0 0 0"
				else printf "%.1f %d %d\n", int(1000 * covered / total) / 10, covered, total
			}
		}
	' "$2"
}

# gate_ok COVERED TOTAL: true if package coord passes the coverage gate:
# with ${COVERAGE_GATE:-100} at 100 (or above), no statement missed; below,
# at least that percentage, unrounded. No statement at all fails.
gate_ok() {
	awk -v c="$1" -v t="$2" -v g="${COVERAGE_GATE:-100}" \
		'BEGIN { exit !(t > 0 && (g + 0 >= 100 ? c + 0 == t + 0 : 100 * c >= g * t)) }'
}

# check_skips [FILE]: true if every line of the declared skips (default
# .ci/skips) is blank, a # comment, or a test name followed by its reason;
# else prints the bad lines.
check_skips() {
	local f=${1:-$ci_skips}
	[ -e "$f" ] || return 0
	awk '
		/^[ \t]*(#|$)/ { next }
		$1 !~ /^(Test|Example|Fuzz)/ { printf "%s:%d: not a test name: %s\n", FILENAME, FNR, $1; bad = 1; next }
		NF < 2 { printf "%s:%d: %s: no reason given\n", FILENAME, FNR, $1; bad = 1 }
		END { exit bad }
	' "$f"
}

# skipped_tests LOG [SKIPS]: the tests, subtests and examples of a
# `go test -json` log that were skipped, one a line, tab-separated:
#   declared|undeclared  TEST  PACKAGE  REASON
# declared if TEST (as go test names it: TestX, TestX/sub) is in SKIPS
# (default .ci/skips); REASON is the test's last line of output (t.Skip's).
skipped_tests() {
	awk -v skips="${2:-$ci_skips}" "$json_awk"'
		BEGIN {
			while ((getline l < skips) > 0) {
				if (l ~ /^[ \t]*(#|$)/) continue
				split(l, f); declared[f[1]] = 1
			}
		}
		{
			test = unjson(field("Test"))
			if (test == "") next
			action = field("Action"); key = field("Package") " " test
			if (action == "output") {
				text = unjson(field("Output")); sub(/\n$/, "", text); sub(/^[ \t]+/, "", text)
				if (text != "" && text !~ /^(=== |--- )/) last[key] = text
			} else if (action == "skip") {
				printf "%s\t%s\t%s\t%s\n", (test in declared) ? "declared" : "undeclared", test, unjson(field("Package")), last[key]
			}
		}
	' "$1"
}

# count_tests ACTION LOG: how many tests, subtests and examples of a
# `go test -json` log ended with ACTION (pass or skip); for fail, also
# those that never ended (their binary crashed or timed out).
count_tests() {
	awk -v want="$1" '
		match($0, /"Action":"[a-z]+","Package":"[^"]*","Test":"([^"\\]|\\.)*"/) {
			s = substr($0, RSTART, RLENGTH)
			action = s; sub(/^"Action":"/, "", action); sub(/".*/, "", action)
			key = s; sub(/^"Action":"[a-z]+",/, "", key)
			if (action == "run") open[key] = 1
			else if (action == "pass" || action == "fail" || action == "skip") {
				delete open[key]
				if (action == want) n++
			}
		}
		END { if (want == "fail") for (k in open) n++; print n + 0 }
	' "$2"
}

# json_awk: awk functions to read a `go test -json` line (mawk: no JSON
# parser, no jq): field(NAME) is the raw value of string field NAME of $0,
# unjson(S) decodes a raw JSON string value.
# shellcheck disable=SC2016 # awk's $0, not the shell's
json_awk='
	function unjson(s,    out, i, c, n, h) {
		out = ""
		n = length(s)
		for (i = 1; i <= n; i++) {
			c = substr(s, i, 1)
			if (c != "\\") { out = out c; continue }
			c = substr(s, ++i, 1)
			if (c == "n") out = out "\n"
			else if (c == "t") out = out "\t"
			else if (c == "r") { }
			else if (c == "b" || c == "f") { }
			else if (c == "u") {
				h = substr(s, i + 1, 4); i += 4
				if (h == "003c") out = out "<"
				else if (h == "003e") out = out ">"
				else if (h == "0026") out = out "&"
				else out = out "?"
			} else out = out c
		}
		return out
	}
	function field(name,    re) {
		re = "\"" name "\":\"([^\"\\\\]|\\\\.)*\""
		if (!match($0, re)) return ""
		return substr($0, RSTART + length(name) + 4, RLENGTH - length(name) - 5)
	}
'

# json_text [LOG]: turns a `go test -json` stream (file or stdin) back into
# what `go test` without -v prints: package result lines, anything printed
# outside a test (build errors, panics, TestMain's goleak report), and the
# output of each test that fails or never ends (a crash, a timeout: its
# first and last 40 lines). Streams,
# flushing each line; decodes the JSON strings itself (mawk, no jq).
json_text() {
	awk -v keep=40 "$json_awk"'
	function flush_test(key,    n, i) {
		n = nlines[key]
		for (i = 1; i <= n; i++) {
			if (i == keep + 1 && n > 2 * keep) {
				printf "    [... %d lines omitted ...]\n", n - 2 * keep
				i = n - keep
			}
			printf "%s", line[key, i]
		}
		fflush()
	}
	function forget(key,    n, i) {
		n = nlines[key]
		for (i = 1; i <= n; i++) delete line[key, i]
		delete nlines[key]
	}
	{
		action = field("Action"); test = field("Test"); pkg = field("Package")
		key = pkg " " test
		if (action == "output" || action == "build-output") {
			text = unjson(field("Output"))
			if (test != "") {
				if (text !~ /^=== (RUN|PAUSE|CONT|NAME) /) line[key, ++nlines[key]] = text
			} else if (text !~ /^(=== |PASS\n$|coverage: )/) {
				if (action == "output" && text ~ /^(FAIL|ok)[ \t]/) {
					# The package result: first the output of its tests
					# that never ended (the binary crashed or timed out).
					for (k in nlines) if (index(k, pkg " ") == 1) { flush_test(k); forget(k) }
				}
				printf "%s", text; fflush()
			}
		} else if (test != "" && action == "fail") {
			flush_test(key); forget(key)
		} else if (test != "" && (action == "pass" || action == "skip")) {
			forget(key)
		}
	}
	' "${1:--}"
}

# fmt_secs N: N seconds as "MmSSs".
fmt_secs() { printf '%dm%02ds' $(( $1 / 60 )) $(( $1 % 60 )); }

# result_row TARGET LOG PROFILE SECONDS RC: one tab-separated result line,
#   target  passed  failed  skipped  coverage  seconds  status
# LOG is the `go test -json` output, PROFILE the -coverprofile (empty: no
# coverage, no gate), RC go test's exit status. status is ok, FAIL (go test
# failed), or else GATE (package coord misses the coverage gate: see
# gate_ok), SKIP (a test skipped that .ci/skips does not declare), or
# GATE+SKIP.
result_row() {
	local target=$1 log=$2 profile=$3 secs=$4 rc=$5 pct=- covered=0 total=0 status=''
	local skipped undeclared
	if [ -n "$profile" ]; then
		pct=0.0
		if [ -s "$profile" ]; then read -r pct covered total <<< "$(coverage_stats "$profile")"; fi
	fi
	skipped=$(skipped_tests "$log")
	undeclared=$(grep -c '^undeclared' <<< "$skipped" || true)
	if [ "$rc" != 0 ]; then
		status=FAIL
	else
		if [ "$pct" != - ] && ! gate_ok "$covered" "$total"; then status=GATE; fi
		if [ "$undeclared" != 0 ]; then status=${status:+$status+}SKIP; fi
	fi
	printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$target" "$(count_tests pass "$log")" \
		"$(count_tests fail "$log")" "$(count_tests skip "$log")" "$pct" "$secs" "${status:-ok}"
}

# run_report LOG PROFILE: what a result row sums up, in words: the coverage
# of package coord and the blocks no test ran (PROFILE empty: no coverage),
# the tests skipped, and those of them that .ci/skips does not declare,
# with the reason each gave.
run_report() {
	local log=$1 profile=$2 pct=0.0 covered=0 total=0 skipped n declared
	if [ -n "$profile" ]; then
		if [ -s "$profile" ]; then read -r pct covered total <<< "$(coverage_stats "$profile")"; fi
		echo "coverage of package coord: ${pct}% of statements ($covered of $total)"
		if [ "$total" = 0 ]; then
			echo "coverage gate missed: no statement of package coord in the profile"
		elif ! gate_ok "$covered" "$total"; then
			echo "coverage gate missed (${COVERAGE_GATE:-100}%, unrounded: at 100, every statement must run); never run:"
			missed_blocks "$profile" | sed 's/^/  /'
		fi
	fi
	skipped=$(skipped_tests "$log")
	n=$(count_tests skip "$log")
	declared=$(grep -c '^declared' <<< "$skipped" || true)
	echo "tests skipped: $n ($declared declared in .ci/skips)"
	if grep -q '^undeclared' <<< "$skipped"; then
		echo "skipped, and not declared in .ci/skips (a test name and the reason, one a line):"
		awk -F'\t' '$1 == "undeclared" { printf "  %s (%s): %s\n", $2, $3, $4 }' <<< "$skipped"
	fi
}

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
