package main

import (
	"fmt"
	"os"
	"strings"
)

// gate is the coverage gate, $COVERAGE_GATE (default 100), as given.
func gate() string {
	if g := os.Getenv("COVERAGE_GATE"); g != "" {
		return g
	}
	return "100"
}

// gateOK reports whether package coord passes the coverage gate: with the
// gate at 100 (or above), no statement missed; below, at least that
// percentage, unrounded. No statement at all fails.
func gateOK(covered, total float64) bool {
	g := awkNum(gate())
	if total <= 0 {
		return false
	}
	if g >= 100 {
		return covered == total
	}
	return 100*covered >= g*total
}

// profileStats is the coverage of a profile that has anything in it, as
// printed (PERCENT COVERED TOTAL), and the profile; else "0.0 0 0" and nil.
func profileStats(profile string) (pct, covered, total string, c *coverage, err error) {
	pct, covered, total = "0.0", "0", "0"
	if fi, err := os.Stat(profile); err != nil || fi.Size() == 0 {
		return pct, covered, total, nil, nil
	}
	if c, err = readCoverage(profile); err != nil {
		return "", "", "", nil, err
	}
	f := strings.Fields(c.stats())
	return f[0], f[1], f[2], c, nil
}

// rowCmd prints the result row of a run (LOG and PROFILE from go test, RC
// its exit status), tab-separated:
//
//	target  passed  failed  skipped  coverage  seconds  status
//
// coverage is "-" without a PROFILE; status is ok, FAIL (go test failed),
// or else GATE (package coord misses the coverage gate), SKIP (a test
// skipped that SKIPS does not declare), or GATE+SKIP.
func rowCmd(w writer, target, logName, profile, secs, rc, skipsName string) error {
	l, declared, err := readLogAndSkips(logName, skipsName)
	if err != nil {
		return err
	}
	pct, gateMissed := "-", false
	if profile != "" {
		var covered, total string
		if pct, covered, total, _, err = profileStats(profile); err != nil {
			return err
		}
		gateMissed = !gateOK(awkNum(covered), awkNum(total))
	}
	var status []string
	if rc != "0" {
		status = append(status, "FAIL")
	} else {
		if gateMissed {
			status = append(status, "GATE")
		}
		for _, s := range l.skipped {
			if !declared[s.test] {
				status = append(status, "SKIP")
				break
			}
		}
	}
	if status == nil {
		status = []string{"ok"}
	}
	fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%s\t%s\t%s\n", target, l.count("pass"), l.count("fail"), l.count("skip"),
		pct, secs, strings.Join(status, "+"))
	return nil
}

// reportCmd prints what a result row sums up, in words: the coverage of
// package coord and the blocks no test ran (PROFILE "": no coverage), the
// tests skipped, and those of them that SKIPS does not declare, with the
// reason each gave.
func reportCmd(w writer, logName, profile, skipsName string) error {
	l, declared, err := readLogAndSkips(logName, skipsName)
	if err != nil {
		return err
	}
	if profile != "" {
		pct, covered, total, c, err := profileStats(profile)
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "coverage of package coord: %s%% of statements (%s of %s)\n", pct, covered, total)
		if total == "0" {
			fmt.Fprintln(w, "coverage gate missed: no statement of package coord in the profile")
		} else if !gateOK(awkNum(covered), awkNum(total)) {
			fmt.Fprintf(w, "coverage gate missed (%s%%, unrounded: at 100, every statement must run); never run:\n", gate())
			c.missed(w, "  ", 100)
		}
	}
	var undeclared []skip
	for _, s := range l.skipped {
		if !declared[s.test] {
			undeclared = append(undeclared, s)
		}
	}
	fmt.Fprintf(w, "tests skipped: %d (%d declared in .ci/skips)\n", l.count("skip"), len(l.skipped)-len(undeclared))
	if len(undeclared) > 0 {
		fmt.Fprintln(w, "skipped, and not declared in .ci/skips (a test name and the reason, one a line):")
		for _, s := range undeclared {
			fmt.Fprintf(w, "  %s (%s): %s\n", s.test, s.pkg, s.reason)
		}
	}
	return nil
}
