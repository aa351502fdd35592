// Command report reads what the CI scripts collect: `go test -json` logs,
// coverage profiles and the declared skips (.ci/skips). The scripts build it
// once per run, for the host (see build_ci_tool in .ci/lib.sh), and call its
// subcommands:
//
//	text [LOG]                    what plain `go test` prints, from a JSON log (default: stdin)
//	skips LOG [SKIPS]             the skipped tests: declared|undeclared TEST PACKAGE REASON
//	count ACTION LOG              how many tests ended with ACTION (pass, fail, skip)
//	row TARGET LOG PROFILE SECONDS RC SKIPS
//	                              the result row of a run (see .ci/gotest)
//	report LOG PROFILE SKIPS      the coverage, the blocks never run and the skips, in words
//	coverage PROFILE              package coord's coverage: PERCENT COVERED TOTAL
//	missed PROFILE [MAX]          package coord's blocks that no test ran
//	checkskips SKIPS              checks the declared skips' format
//	compat LABEL LOG [LABEL LOG]...
//	                              the table of the compatibility suite's runs: promise × etcd version
//
// PROFILE "" means no coverage. The coverage gate is $COVERAGE_GATE (default
// 100). Standard library only: it builds on a fresh machine with Go alone.
package main

import (
	"fmt"
	"os"
	"strconv"
)

func usage() {
	fmt.Fprintln(os.Stderr, "usage: report text [LOG] | skips LOG [SKIPS] | count ACTION LOG | row TARGET LOG PROFILE SECONDS RC SKIPS | report LOG PROFILE SKIPS | coverage PROFILE | missed PROFILE [MAX] | checkskips SKIPS | compat LABEL LOG...")
	os.Exit(2)
}

// fail reports an error the way a failing awk or shell command would: on
// stderr, exit status 2.
func fail(err error) {
	fmt.Fprintln(os.Stderr, "report:", err)
	os.Exit(2)
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	args := os.Args[2:]
	nargs := func(min, max int) {
		if len(args) < min || len(args) > max {
			usage()
		}
	}
	arg := func(i int, def string) string {
		if i < len(args) {
			return args[i]
		}
		return def
	}
	w := newWriter(os.Stdout)
	defer w.Flush()
	var err error
	code := 0
	switch os.Args[1] {
	case "text":
		nargs(0, 1)
		err = textCmd(w, arg(0, "-"))
	case "skips":
		nargs(1, 2)
		err = skipsCmd(w, args[0], arg(1, ""))
	case "count":
		nargs(2, 2)
		var log *testLog
		if log, err = readLog(args[1]); err == nil {
			fmt.Fprintln(w, log.count(args[0]))
		}
	case "row":
		nargs(6, 6)
		err = rowCmd(w, args[0], args[1], args[2], args[3], args[4], args[5])
	case "report":
		nargs(3, 3)
		err = reportCmd(w, args[0], args[1], args[2])
	case "coverage":
		nargs(1, 1)
		var c *coverage
		if c, err = readCoverage(args[0]); err == nil {
			fmt.Fprintln(w, c.stats())
		}
	case "missed":
		nargs(1, 2)
		max := 100
		if len(args) > 1 {
			max = int(awkNum(args[1]))
		}
		var c *coverage
		if c, err = readCoverage(args[0]); err == nil {
			c.missed(w, "", max)
		}
	case "checkskips":
		nargs(1, 1)
		var ok bool
		if ok, err = checkSkips(w, args[0]); err == nil && !ok {
			code = 1
		}
	case "compat":
		var ok bool
		if ok, err = compatCmd(w, args); err == nil && !ok {
			code = 1
		}
	default:
		usage()
	}
	if err != nil {
		w.Flush()
		fail(err)
	}
	if code != 0 {
		w.Flush()
		os.Exit(code)
	}
}

// awkNum is the number at the start of s, as awk reads a string as a number
// (leading blanks skipped; no number: 0).
func awkNum(s string) float64 {
	i := 0
	for i < len(s) && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n') {
		i++
	}
	s = s[i:]
	// The longest prefix that is a decimal number.
	for j := len(s); j > 0; j-- {
		if v, err := strconv.ParseFloat(s[:j], 64); err == nil && isDecimal(s[:j]) {
			return v
		}
	}
	return 0
}

// isDecimal reports whether s is a plain decimal number: sign, digits,
// point, exponent (not hex, inf, nan or underscores, which ParseFloat takes).
func isDecimal(s string) bool {
	for _, c := range s {
		if !(c >= '0' && c <= '9' || c == '.' || c == '+' || c == '-' || c == 'e' || c == 'E') {
			return false
		}
	}
	return true
}
