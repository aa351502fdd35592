package main

import (
	"bufio"
	"fmt"
	"math"
	"os"
	"regexp"
	"strings"
)

// A coverage profile's line: FILE:LINE.COL,LINE.COL STATEMENTS COUNT.
var (
	blockPos = regexp.MustCompile(`:[0-9]+\.[0-9]+,[0-9]+\.[0-9]+$`)
	// Package coord's own files: not coordtest's, not cmd's.
	coordFile = regexp.MustCompile(`^github\.com/go-coord/coord/[^/]+\.go$`)
)

// coverage is package coord's blocks of statements in a profile, in the
// profile's order. A block counts once however often it appears (the
// profiles of several test binaries merged), as run if any of its lines
// has a count above 0.
type coverage struct {
	order []string
	block map[string]*block
}

type block struct{ stmts, count float64 }

func readCoverage(name string) (*coverage, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	c := &coverage{block: map[string]*block{}}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<30)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "mode:") {
			continue
		}
		fs := fields(line)
		if len(fs) != 3 {
			continue
		}
		loc := blockPos.FindStringIndex(fs[0])
		if loc == nil || !coordFile.MatchString(fs[0][:loc[0]]) {
			continue
		}
		b := c.block[fs[0]]
		if b == nil {
			b = &block{stmts: awkNum(fs[1])}
			c.block[fs[0]] = b
			c.order = append(c.order, fs[0])
		}
		if n := awkNum(fs[2]); n > b.count {
			b.count = n
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return c, f.Close()
}

// totals is how many statements of package coord ran, of how many.
func (c *coverage) totals() (covered, total float64) {
	for _, name := range c.order {
		b := c.block[name]
		total += b.stmts
		if b.count > 0 {
			covered += b.stmts
		}
	}
	return covered, total
}

// stats is "PERCENT COVERED TOTAL" (statements); PERCENT is truncated to
// one decimal: 100.0 only when no statement is missed.
func (c *coverage) stats() string {
	covered, total := c.totals()
	if total == 0 {
		return "0.0 0 0"
	}
	return fmt.Sprintf("%.1f %d %d", math.Trunc(1000*covered/total)/10, int64(covered), int64(total))
}

// missed prints the blocks no test ran, one a line after indent:
// "FILE:START,END: N statements"; past max, how many more.
func (c *coverage) missed(w writer, indent string, max int) {
	n := 0
	for _, name := range c.order {
		b := c.block[name]
		if b.count > 0 || b.stmts <= 0 {
			continue
		}
		if n++; n <= max {
			s := "s"
			if b.stmts == 1 {
				s = ""
			}
			fmt.Fprintf(w, "%s%s: %d statement%s\n", indent, name, int64(b.stmts), s)
		}
	}
	if n > max {
		fmt.Fprintf(w, "%s... and %d more blocks\n", indent, n-max)
	}
}
