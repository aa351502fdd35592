package main

import (
	"slices"
	"strings"
	"testing"
)

func TestUIDemo(t *testing.T) {
	t.Parallel()
	t.Run("demo --ui ADDR serves the page through the acts: the crash and the failover show live", func(t *testing.T) {
		d := startCoord(t, "demo", "--ui", "127.0.0.1:0", "--ttl", demoTestTTL.String())
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("the demo's stdout:\n%s\nstderr:\n%s", d.stdout.String(), d.stderr.String())
			}
		})
		d.waitOutput(t, d.stdout, "the fleet's page is at ")
		url := strings.Fields(strings.SplitAfter(d.stdout.String(), "page is at ")[1])[0]
		url = strings.TrimSuffix(url, ":")
		ev := openEvents(t, url)
		ev.until(t, "node-4 down", func(v uiView) bool {
			return slices.ContainsFunc(v.Hosts, func(h uiHost) bool { return h.Hostname == "node-4" && h.Down })
		})
		ev.until(t, "node-2 leads", func(v uiView) bool {
			return slices.ContainsFunc(v.Elections, func(e uiElection) bool { return e.Key == demoElection && e.Leader.Identity == "node-2" })
		})
		ev.until(t, "the shard set", func(v uiView) bool { return len(v.Shards.Shards) == demoShards })
		ev.until(t, "the semaphore", func(v uiView) bool { return len(v.Semaphores) == 1 })
		d.waitOutput(t, d.stdout, "the acts are over; the page stays until Ctrl-C")
		r := d.stop(t)
		if r.code != exitOK || !strings.Contains(r.stdout, "the page is open") {
			t.Fatalf("status %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
		}
		ev.closed(t)
	})
	t.Run("--ui alone is 127.0.0.1:8080; an argument without --ui is refused", func(t *testing.T) {
		for _, tc := range []struct {
			args []string
			want string
		}{{[]string{"--ui"}, demoUIDefault}, {[]string{"--ui=:0"}, ":0"}, {[]string{"--ui", "h:1"}, "h:1"}, {nil, ""}} {
			c := newCmdFlags("demo", "", "", false)
			u := demoUIFlag(c)
			pos, err := c.parse(tc.args, nil, 0)
			if err == nil {
				err = u.address(pos)
			}
			if err != nil || u.addr != tc.want {
				t.Errorf("demo %v: address %q, %v; want %q", tc.args, u.addr, err, tc.want)
			}
		}
		if r := runCoord(t, "demo", "127.0.0.1:0"); r.code != exitUsage {
			t.Errorf("demo 127.0.0.1:0: status %d, stderr %q", r.code, r.stderr)
		}
		for _, ttl := range []string{"500ms", "1500ms"} {
			if r := runCoord(t, "demo", "--ttl", ttl); r.code != exitUsage || !strings.Contains(r.stderr, "whole seconds") {
				t.Errorf("demo --ttl %s: status %d, stderr %q", ttl, r.code, r.stderr)
			}
		}
	})
}
