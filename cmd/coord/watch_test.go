package main

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"

	"github.com/go-coord/coord"
)

func TestWatch(t *testing.T) {
	t.Parallel()
	_, ep, cli := newEtcd(t)
	register(t, cli, coord.HostMetadata{HostUUID: "early", Hostname: "e"}, coord.LivenessOptions{Prefix: "/w/"})

	t.Run("text: the live hosts, then each change, until interrupted", func(t *testing.T) {
		w := startCoord(t, "watch", "--endpoints", ep, "--prefix", "/w/")
		w.waitOutput(t, w.stderr, "1 hosts live under /w/; watching")
		w.waitOutput(t, w.stdout, "early")
		h := register(t, cli, coord.HostMetadata{HostUUID: "late", Hostname: "l", Version: "2.0",
			Labels: map[string]string{"k": "v"}}, coord.LivenessOptions{Prefix: "/w/"})
		w.waitOutput(t, w.stdout, "late")
		if err := h.Update(context.Background(), coord.HostMetadata{HostUUID: "late", Hostname: "l", Version: "2.1"}); err != nil {
			t.Fatal(err)
		}
		w.waitOutput(t, w.stdout, "version=2.1")
		if err := h.Stop(context.Background()); err != nil {
			t.Fatal(err)
		}
		w.waitOutput(t, w.stdout, "down")
		r := w.stop(t)
		if r.code != exitOK {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		want := []*regexp.Regexp{
			regexp.MustCompile(`^\d\d:\d\d:\d\d\.\d{3}  up       early  hostname=e version=-  rev=\d+ synthetic$`),
			regexp.MustCompile(`^\d\d:\d\d:\d\d\.\d{3}  up       late  hostname=l version=2.0 labels=k=v  rev=\d+$`),
			regexp.MustCompile(`^\d\d:\d\d:\d\d\.\d{3}  updated  late  hostname=l version=2.1  rev=\d+$`),
			regexp.MustCompile(`^\d\d:\d\d:\d\d\.\d{3}  down     late  hostname=l version=2.1  rev=\d+$`),
		}
		if len(lines) != len(want) {
			t.Fatalf("want %d lines, got:\n%s", len(want), r.stdout)
		}
		for i, re := range want {
			if !re.MatchString(lines[i]) {
				t.Errorf("line %d %q does not match %s", i, lines[i], re)
			}
		}
	})

	t.Run("-o json: an object per line", func(t *testing.T) {
		w := startCoord(t, "--endpoints", ep, "watch", "--prefix", "/w/", "-o", "json")
		w.waitOutput(t, w.stdout, `"early"`)
		h := register(t, cli, coord.HostMetadata{HostUUID: "json-host"}, coord.LivenessOptions{Prefix: "/w/"})
		w.waitOutput(t, w.stdout, `"json-host"`)
		if err := h.Stop(context.Background()); err != nil {
			t.Fatal(err)
		}
		w.waitOutput(t, w.stdout, `"down"`)
		r := w.stop(t)
		if r.code != exitOK {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		var kinds []string
		for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
			var ev watchEvent
			if err := json.Unmarshal([]byte(line), &ev); err != nil {
				t.Fatalf("%v: %q", err, line)
			}
			if ev.Time.IsZero() || ev.Revision == 0 || ev.Metadata.HostUUID != ev.HostUUID {
				t.Errorf("incomplete event %q", line)
			}
			kinds = append(kinds, ev.Kind+" "+ev.HostUUID)
		}
		if got := strings.Join(kinds, ", "); got != "up early, up json-host, down json-host" {
			t.Errorf("events: %s", got)
		}
	})
}
