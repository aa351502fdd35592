package main

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"unicode"
)

// compatTag starts the log lines of the compatibility suite that carry
// figures: "compat: PROMISE NAME=VALUE ..." (see compat_test.go).
const compatTag = "compat: "

// compatRun is what one run of the compatibility suite (one etcd version)
// says: each promise's result and figures.
type compatRun struct {
	label    string
	promises []string                     // in the order the suite ran them
	results  map[string]string            // by promise: pass, fail, skip
	figures  map[string]map[string]string // by promise, then figure name
	names    map[string][]string          // by promise: its figures' names, in order
	reasons  map[string]string            // by promise: why it skipped
}

func newCompatRun(label string) *compatRun {
	return &compatRun{label: label, results: map[string]string{}, figures: map[string]map[string]string{},
		names: map[string][]string{}, reasons: map[string]string{}}
}

// figure records the figure k=v of promise p.
func (run *compatRun) figure(p, k, v string) {
	figs := run.figures[p]
	if figs == nil {
		figs = map[string]string{}
		run.figures[p] = figs
	}
	if _, ok := figs[k]; !ok {
		run.names[p] = append(run.names[p], k)
	}
	figs[k] = v
}

// promiseName is the row a test of the suite fills: TestCompat/liveness is
// "liveness", TestCompatLeaderChange/checkpoint=false is
// "leader-change/checkpoint=false", TestCompatGRPCProxy/lease (an acronym
// is one word) "grpc-proxy/lease"; "" for another test.
func promiseName(test string) string {
	rest, ok := strings.CutPrefix(test, "TestCompat")
	if !ok {
		return ""
	}
	if r, ok := strings.CutPrefix(rest, "/"); ok {
		return r
	}
	name, sub, _ := strings.Cut(rest, "/")
	if sub != "" {
		sub = "/" + sub
	}
	rs := []rune(name)
	var b strings.Builder
	for i, c := range rs {
		// A word begins at an upper-case letter after a lower-case one,
		// or at the last upper-case letter of an acronym ("GRPCProxy").
		if i > 0 && unicode.IsUpper(c) &&
			(unicode.IsLower(rs[i-1]) || i+1 < len(rs) && unicode.IsLower(rs[i+1])) {
			b.WriteByte('-')
		}
		b.WriteRune(unicode.ToLower(c))
	}
	return b.String() + sub
}

// readCompat reads the `go test -json` log of a run of the suite. A test
// that has subtests is no row of its own.
func readCompat(label, name string) (*compatRun, error) {
	r, err := open(name)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	run := newCompatRun(label)
	parents := map[string]bool{}
	last := map[string]string{}
	known := map[string]bool{}
	err = events(r, func(e event) {
		if i := strings.LastIndex(e.Test, "/"); i > 0 {
			parents[e.Test[:i]] = true
		}
		p := promiseName(e.Test)
		if p == "" {
			return
		}
		if !known[p] {
			known[p] = true
			run.promises = append(run.promises, p)
		}
		switch e.Action {
		case "pass", "fail", "skip":
			run.results[p] = e.Action
			if e.Action == "skip" {
				run.reasons[p] = last[p]
			}
		case "output":
			line := strings.TrimSpace(e.Output)
			if line != "" && !strings.HasPrefix(line, "---") && !strings.HasPrefix(line, "===") {
				last[p] = line
			}
			if i := strings.Index(e.Output, compatTag); i >= 0 {
				// The first field names the promise, for a reader of the log.
				for _, f := range fields(e.Output[i+len(compatTag):])[1:] {
					if k, v, ok := strings.Cut(f, "="); ok {
						run.figure(p, k, v)
					}
				}
			}
		}
	})
	run.promises = slices.DeleteFunc(run.promises, func(p string) bool {
		for parent := range parents {
			if promiseName(parent) == p {
				return true
			}
		}
		return false
	})
	return run, err
}

// compatCmd prints the table of the runs of the suite given as LABEL LOG
// pairs: a row per promise (its result on each run) and, under it, a row
// per figure it logged. It returns false if a promise failed, or passed on
// one run and has no result on another (that run died).
func compatCmd(w writer, args []string) (bool, error) {
	if len(args) == 0 || len(args)%2 != 0 {
		return false, fmt.Errorf("compat: want LABEL LOG pairs, got %d arguments", len(args))
	}
	var runs []*compatRun
	for i := 0; i < len(args); i += 2 {
		run, err := readCompat(args[i], args[i+1])
		if os.IsNotExist(err) {
			run, err = newCompatRun(args[i]), nil // the run died before its log
		}
		if err != nil {
			return false, err
		}
		runs = append(runs, run)
	}
	var promises []string
	order := map[string][]string{}
	for _, run := range runs {
		for _, p := range run.promises {
			if !slices.Contains(promises, p) {
				promises = append(promises, p)
			}
			for _, k := range run.names[p] {
				if !slices.Contains(order[p], k) {
					order[p] = append(order[p], k)
				}
			}
		}
	}
	width := len("PROMISE / FIGURE")
	for _, p := range promises {
		width = max(width, len(p))
		for _, k := range order[p] {
			width = max(width, len(k)+2)
		}
	}
	fmt.Fprintf(w, "%-*s", width, "PROMISE / FIGURE")
	for _, run := range runs {
		fmt.Fprintf(w, "  %-14s", run.label)
	}
	fmt.Fprintln(w)
	ok := true
	var notes []string
	for _, p := range promises {
		fmt.Fprintf(w, "%-*s", width, p)
		for _, run := range runs {
			res := run.results[p]
			switch res {
			case "":
				res, ok = "MISSING", false
			case "fail":
				res, ok = "FAIL", false
			case "skip":
				notes = append(notes, fmt.Sprintf("%s on %s skipped: %s", p, run.label, run.reasons[p]))
			}
			fmt.Fprintf(w, "  %-14s", res)
		}
		fmt.Fprintln(w)
		for _, k := range order[p] {
			fmt.Fprintf(w, "  %-*s", width-2, k)
			for _, run := range runs {
				v := run.figures[p][k]
				if v == "" {
					v = "-"
				}
				fmt.Fprintf(w, "  %-14s", v)
			}
			fmt.Fprintln(w)
		}
	}
	for _, n := range notes {
		fmt.Fprintln(w, n)
	}
	return ok, nil
}
