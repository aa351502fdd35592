package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
)

// skipLine is a line of the declared skips (.ci/skips) that is neither
// blank nor a # comment: its fields (split at blanks), and its number.
type skipLine struct {
	fields []string
	n      int
}

// readSkipLines reads the declared skips; a missing file declares none.
func readSkipLines(name string) ([]skipLine, error) {
	if name == "" {
		return nil, nil
	}
	data, err := os.ReadFile(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var lines []skipLine
	for i, line := range strings.Split(strings.TrimSuffix(string(data), "\n"), "\n") {
		rest := strings.TrimLeft(line, " \t")
		if rest == "" || rest[0] == '#' {
			continue
		}
		lines = append(lines, skipLine{fields(line), i + 1})
	}
	return lines, nil
}

// fields splits s at runs of blanks, as awk does by default.
func fields(s string) []string {
	return strings.FieldsFunc(s, func(r rune) bool { return r == ' ' || r == '\t' || r == '\n' })
}

// readSkips is the set of the test names that the declared skips name.
func readSkips(name string) (map[string]bool, error) {
	lines, err := readSkipLines(name)
	if err != nil {
		return nil, err
	}
	declared := map[string]bool{}
	for _, l := range lines {
		declared[l.fields[0]] = true
	}
	return declared, nil
}

// checkSkips reports whether every line of the declared skips is blank, a
// # comment, or a test name followed by its reason; it prints the others.
func checkSkips(w writer, name string) (bool, error) {
	lines, err := readSkipLines(name)
	if err != nil {
		return false, err
	}
	ok := true
	for _, l := range lines {
		switch {
		case !hasAnyPrefix(l.fields[0], "Test", "Example", "Fuzz"):
			fmt.Fprintf(w, "%s:%d: not a test name: %s\n", name, l.n, l.fields[0])
			ok = false
		case len(l.fields) < 2:
			fmt.Fprintf(w, "%s:%d: %s: no reason given\n", name, l.n, l.fields[0])
			ok = false
		}
	}
	return ok, nil
}

// readLogAndSkips reads the go test -json log and the declared skips that
// every command judging a run needs.
func readLogAndSkips(logName, skipsName string) (*testLog, map[string]bool, error) {
	l, err := readLog(logName)
	if err != nil {
		return nil, nil, err
	}
	declared, err := readSkips(skipsName)
	if err != nil {
		return nil, nil, err
	}
	return l, declared, nil
}
