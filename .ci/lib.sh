# shellcheck shell=bash
# Shared helpers of the CI scripts (sourced, not run). Plain bash + awk:
# nothing to install on a fresh Debian machine.

# coverage_pct PROFILE: the statement coverage of package coord's own files
# (not coordtest, not cmd), exactly as .ci/run's gate computes it.
coverage_pct() {
	awk -F'[: ]' '
		NR > 1 && $1 ~ /^github.com\/go-coord\/coord\/[^\/]+\.go$/ {
			n = $(NF-1); total += n; if ($NF > 0) covered += n
		}
		END { if (total == 0) { print "0.0" } else { printf "%.1f", 100 * covered / total } }
	' "$1"
}

# below_gate PCT: true if PCT is below ${COVERAGE_GATE:-100.0}.
below_gate() {
	awk -v p="$1" -v g="${COVERAGE_GATE:-100.0}" 'BEGIN { exit !(p + 0 < g + 0) }'
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

# json_text [LOG]: turns a `go test -json` stream (file or stdin) back into
# what `go test` without -v prints: package result lines, anything printed
# outside a test (build errors, panics, TestMain's goleak report), and the
# output of each test that fails or never ends (a crash, a timeout: its
# first and last 40 lines). Streams,
# flushing each line; decodes the JSON strings itself (mawk, no jq).
json_text() {
	awk -v keep=40 '
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
#   target  passed  failed  coverage  seconds  status
# LOG is the `go test -json` output, PROFILE the -coverprofile (empty: no
# coverage, no gate), RC go test's exit status. status is ok, FAIL (go test
# failed) or GATE (tests passed, coverage below ${COVERAGE_GATE:-100.0}).
result_row() {
	local target=$1 log=$2 profile=$3 secs=$4 rc=$5 pct=- status=ok
	if [ -n "$profile" ]; then
		pct=0.0
		if [ -s "$profile" ]; then pct=$(coverage_pct "$profile"); fi
	fi
	if [ "$rc" != 0 ]; then
		status=FAIL
	elif [ "$pct" != - ] && below_gate "$pct"; then
		status=GATE
	fi
	printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$target" "$(count_tests pass "$log")" \
		"$(count_tests fail "$log")" "$pct" "$secs" "$status"
}

# print_table ROWFILE...: the result table, one line per row file. A
# missing or empty row file (its run died) is shown as a failure.
print_table() {
	local f target passed failed pct secs status cov
	printf '%-16s %7s %7s %9s %8s  %s\n' TARGET PASSED FAILED COVERAGE WALL STATUS
	for f in "$@"; do
		if [ -s "$f" ]; then
			IFS=$'\t' read -r target passed failed pct secs status < "$f"
		else
			target=$(basename "$f" .row) passed='?' failed='?' pct=- secs=0 status=FAIL
		fi
		cov=$pct; [ "$pct" = - ] || cov="$pct%"
		printf '%-16s %7s %7s %9s %8s  %s\n' "$target" "$passed" "$failed" "$cov" "$(fmt_secs "$secs")" "$status"
	done
}

# rows_ok ROWFILE...: true if every row says ok.
rows_ok() {
	local f
	for f in "$@"; do
		[ -s "$f" ] && [ "$(cut -f6 "$f")" = ok ] || return 1
	done
}
