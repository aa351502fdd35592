package main

import (
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestDemo(t *testing.T) {
	t.Parallel()
	t.Run("runs end to end by itself, with the delays it measured", func(t *testing.T) {
		r := runCoord(t, "demo")
		t.Logf("coord demo (%v):\n%s", r.took, r.stdout)
		if r.code != exitOK || r.stderr != "" {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		if r.took > 20*time.Second*scale {
			t.Errorf("took %v", r.took)
		}
		stamp := regexp.MustCompile(`^\d\d:\d\d:\d\d\.\d{3}  `)
		for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
			if !stamp.MatchString(line) && !strings.HasSuffix(line, " ms") {
				t.Errorf("line without a timestamp: %q", line)
			}
		}
		for _, want := range []string{
			"up   node-1", "up   node-4",
			"node-1   leads /coord/elections/scheduler",
			"down node-4", "down node-1", "down node-3",
			"node-2   leads /coord/elections/scheduler",
			"summary", "done in",
		} {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("output lacks %q", want)
			}
		}
		// A crash is noticed once the lease expires: after at least about
		// two thirds of the 2 s TTL (the last renewal), well before 10 s.
		// A Stop is noticed at once.
		delays := map[string]int{}
		row := regexp.MustCompile(`^\s+(\S.*\S)\s+(\d+) ms$`)
		for _, line := range strings.Split(r.stdout, "\n") {
			if m := row.FindStringSubmatch(line); m != nil {
				delays[m[1]], _ = strconv.Atoi(m[2])
			}
		}
		slow := int(scale) // upper bounds stretch on slow machines
		for what, bounds := range map[string][2]int{
			"node-4 crash -> Down seen by the watcher":          {1000, 10000 * slow},
			"node-1 (leader) crash -> Down seen by the watcher": {1000, 10000 * slow},
			"node-1 (leader) crash -> node-2 leads":             {1000, 10000 * slow},
			"node-3 Stop -> Down seen by the watcher":           {0, 1000 * slow},
		} {
			ms, ok := delays[what]
			if !ok || ms < bounds[0] || ms > bounds[1] {
				t.Errorf("summary: %q = %d ms (found: %v), want within %v", what, ms, ok, bounds)
			}
		}
	})

	t.Run("Ctrl-C ends it early and cleanly", func(t *testing.T) {
		d := startCoord(t, "demo")
		d.waitOutput(t, d.stdout, "node-4 crashes")
		r := d.stop(t)
		if r.code != exitError || !strings.Contains(r.stderr, "demo interrupted") {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		if r.took > 10*time.Second*scale {
			t.Errorf("took %v", r.took)
		}
	})
}
