package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// event is the part of a `go test -json` line (see `go doc test2json`) that
// the reports use. Build output has no Package (its ImportPath is not
// needed).
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
}

// key names a test (or subtest, or example) of a package.
type key struct{ pkg, test string }

// events calls f for each line of r that is a JSON object; other lines are
// ignored.
func events(r io.Reader, f func(event)) error {
	br := bufio.NewReaderSize(r, 64<<10)
	for {
		line, err := br.ReadBytes('\n')
		if len(line) > 0 {
			var e event
			if json.Unmarshal(line, &e) == nil {
				f(e)
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

func open(name string) (io.ReadCloser, error) {
	if name == "-" {
		return io.NopCloser(os.Stdin), nil
	}
	return os.Open(name)
}

// writer writes to stdout, buffered; flushed at the end, and after each
// line of the streamed output of text.
type writer struct{ *bufio.Writer }

func newWriter(w io.Writer) writer { return writer{bufio.NewWriterSize(w, 64<<10)} }

// keep is how many of its first and last output lines a failing test
// shows.
const keep = 40

// textCmd prints what `go test` without -v prints, from the JSON stream
// LOG ("-": stdin), as it comes: package result lines, anything printed
// outside a test (build errors, panics, TestMain's output), and the output
// of each test that fails or never ends (a crash, a timeout), its first and
// last lines only if it is long.
func textCmd(w writer, name string) error {
	r, err := open(name)
	if err != nil {
		return err
	}
	defer r.Close()
	type buffer struct {
		lines []string
		seq   int
	}
	buffers := map[key]*buffer{}
	seq := 0
	flush := func(k key) {
		b := buffers[k]
		if b == nil {
			return
		}
		lines, end := b.lines, len(b.lines)
		if end > 0 && strings.HasPrefix(strings.TrimLeft(lines[end-1], " "), "--- ") {
			end-- // the test's own result line, printed after the recap
		}
		for i := 1; i <= end; i++ {
			if i == keep+1 && end > 2*keep {
				fmt.Fprintf(w, "    [... %d lines omitted ...]\n", end-2*keep)
				i = end - keep
			}
			w.WriteString(lines[i-1])
		}
		if messages := failureLines(lines[:end]); len(messages) > 0 {
			fmt.Fprintln(w, "    [again, the first lines not from a dump:]")
			for _, m := range messages {
				w.WriteString(m)
			}
		}
		for _, l := range lines[end:] {
			w.WriteString(l)
		}
		delete(buffers, k)
	}
	err = events(r, func(e event) {
		k := key{e.Package, e.Test}
		switch {
		case e.Action == "output" || e.Action == "build-output":
			text := e.Output
			if e.Test != "" {
				if !hasAnyPrefix(text, "=== RUN ", "=== PAUSE ", "=== CONT ", "=== NAME ") {
					b := buffers[k]
					if b == nil {
						seq++
						b = &buffer{seq: seq}
						buffers[k] = b
					}
					b.lines = append(b.lines, text)
				}
				return
			}
			if hasAnyPrefix(text, "=== ", "coverage: ") || text == "PASS\n" {
				return
			}
			if e.Action == "output" && hasAnyPrefix(text, "FAIL ", "FAIL\t", "ok ", "ok\t") {
				// The package result: first the output of its tests that
				// never ended (the binary crashed or timed out), in the
				// order they began to print.
				var open []key
				for bk := range buffers {
					if bk.pkg == e.Package {
						open = append(open, bk)
					}
				}
				sort.Slice(open, func(i, j int) bool { return buffers[open[i]].seq < buffers[open[j]].seq })
				for _, bk := range open {
					flush(bk)
				}
			}
			w.WriteString(text)
			w.Flush()
		case e.Test != "" && e.Action == "fail":
			flush(k)
			w.Flush()
		case e.Test != "" && (e.Action == "pass" || e.Action == "skip"):
			delete(buffers, k)
		}
	})
	if err != nil {
		return err
	}
	return r.Close()
}

// recap is how many lines of a long failing output are shown again at
// its end, and long is the output that gets a recap.
const recap, long = 5, 12

// failureLines returns, for the output of a failing test longer than long,
// its first recap lines logged from a call site (file:line) other than
// those that logged more than long lines (a dump): a t.Fatal's message
// comes before a log dumped in a cleanup, and without the recap only the
// dump's last lines would stand next to the test's result line. Nil for a
// short output, or one without a dump.
func failureLines(lines []string) []string {
	if len(lines) <= long {
		return nil
	}
	site := func(l string) string {
		f := strings.Fields(l)
		if len(f) == 0 || !strings.HasSuffix(f[0], ":") || !strings.Contains(f[0], ".go:") {
			return ""
		}
		return f[0]
	}
	count, dumped := map[string]int{}, false
	for _, l := range lines {
		s := site(l)
		count[s]++
		dumped = dumped || s != "" && count[s] > long
	}
	if !dumped {
		return nil
	}
	var out []string
	for _, l := range lines {
		if s := site(l); s != "" && count[s] <= long && len(out) < recap {
			out = append(out, l)
		}
	}
	return out
}

func hasAnyPrefix(s string, prefixes ...string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

// testLog is what a whole `go test -json` log says about its tests.
type testLog struct {
	ended   map[string]int // tests, subtests and examples per final action
	running map[key]bool   // those that began and never ended
	skipped []skip         // in the log's order
}

// skip is a test that skipped, and its last line of output (t.Skip's
// reason, normally).
type skip struct {
	test, pkg, reason string
}

func readLog(name string) (*testLog, error) {
	r, err := open(name)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	l := &testLog{ended: map[string]int{}, running: map[key]bool{}}
	last := map[key]string{}
	err = events(r, func(e event) {
		if e.Test == "" {
			return
		}
		k := key{e.Package, e.Test}
		switch e.Action {
		case "run":
			l.running[k] = true
		case "pass", "fail", "skip":
			delete(l.running, k)
			l.ended[e.Action]++
		case "output":
			text := strings.TrimLeft(strings.TrimSuffix(e.Output, "\n"), " \t")
			if text != "" && !hasAnyPrefix(text, "=== ", "--- ") {
				last[k] = text
			}
		}
		if e.Action == "skip" {
			l.skipped = append(l.skipped, skip{e.Test, e.Package, last[k]})
		}
	})
	if err != nil {
		return nil, err
	}
	return l, r.Close()
}

// count is how many tests ended with action; for fail, also those that
// never ended (their binary crashed or timed out).
func (l *testLog) count(action string) int {
	n := l.ended[action]
	if action == "fail" {
		n += len(l.running)
	}
	return n
}

// skipsCmd prints the skipped tests of LOG, one a line, tab-separated:
// declared|undeclared TEST PACKAGE REASON.
func skipsCmd(w writer, logName, skipsName string) error {
	l, declared, err := readLogAndSkips(logName, skipsName)
	if err != nil {
		return err
	}
	for _, s := range l.skipped {
		d := "undeclared"
		if declared[s.test] {
			d = "declared"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", d, s.test, s.pkg, s.reason)
	}
	return nil
}
