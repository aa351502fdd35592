package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/go-coord/coord"
)

func TestHosts(t *testing.T) {
	t.Parallel()
	_, ep, cli := newEtcd(t)
	register(t, cli, coord.HostMetadata{HostUUID: "host-a", Hostname: "node-a", Version: "1.2.3",
		Labels: map[string]string{"zone": "z1", "tier": "web"}}, coord.LivenessOptions{TTL: 10 * time.Second})
	register(t, cli, coord.HostMetadata{HostUUID: "host-b", Hostname: "node-b"}, coord.LivenessOptions{TTL: 5 * time.Second})
	register(t, cli, coord.HostMetadata{HostUUID: "host-c"}, coord.LivenessOptions{Prefix: "/other/"})
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	// Values under the prefix that are not hosts.
	for k, v := range map[string]string{
		coord.HostsPrefix + "junk":                         "not json",
		coord.HostsPrefix + "x/y":                          `{"host_uuid":"x/y"}`,
		coord.HostsPrefix + "impostor":                     `{"host_uuid":"host-a"}`,
		coord.HostsPrefix + "no-lease-h":                   `{"host_uuid":"no-lease-h"}`,
		coord.HostsPrefix[:len(coord.HostsPrefix)-1] + "x": `{"host_uuid":"x"}`, // not under the prefix
	} {
		if _, err := cli.Put(ctx, k, v); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("a table of the hosts, sorted by UUID, with labels and TTL left", func(t *testing.T) {
		r := runCoord(t, "hosts", "--endpoints", ep)
		if r.code != exitOK {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if len(lines) != 4 {
			t.Fatalf("want a header and 3 hosts, got:\n%s", r.stdout)
		}
		for i, want := range [][]string{
			{"UUID", "HOSTNAME", "VERSION", "LABELS", "TTL LEFT"},
			{"host-a", "node-a", "1.2.3", "tier=web,zone=z1", "of 10s"},
			{"host-b", "node-b", "-", "-", "of 5s"},
			{"no-lease-h", "-", "-", "-", "no lease"},
		} {
			for _, w := range want {
				if !strings.Contains(lines[i], w) {
					t.Errorf("line %d %q lacks %q", i, lines[i], w)
				}
			}
		}
		for _, skipped := range []string{"junk", "x/y", "impostor"} {
			if !strings.Contains(r.stderr, "skipping "+coord.HostsPrefix+skipped) {
				t.Errorf("stderr does not say %s was skipped:\n%s", skipped, r.stderr)
			}
		}
	})

	t.Run("-o json", func(t *testing.T) {
		r := runCoord(t, "hosts", "--endpoints", ep, "-o", "json")
		if r.code != exitOK {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		var hosts []liveHost
		if err := json.Unmarshal([]byte(r.stdout), &hosts); err != nil {
			t.Fatalf("%v in:\n%s", err, r.stdout)
		}
		if len(hosts) != 3 || hosts[0].HostUUID != "host-a" || hosts[1].HostUUID != "host-b" {
			t.Fatalf("got %+v", hosts)
		}
		a := hosts[0]
		if a.Hostname != "node-a" || a.Version != "1.2.3" || a.Labels["zone"] != "z1" || a.Lease == "" ||
			a.GrantedTTL != 10 || a.TTLLeft <= 0 || a.TTLLeft > 10 {
			t.Errorf("host-a: %+v", a)
		}
		if n := hosts[2]; n.Lease != "" || n.TTLLeft != -1 {
			t.Errorf("host without lease: %+v", n)
		}
	})

	t.Run("--prefix", func(t *testing.T) {
		r := runCoord(t, "--prefix", "/other/", "hosts", "--endpoints", ep, "-o", "json")
		var hosts []liveHost
		if err := json.Unmarshal([]byte(r.stdout), &hosts); err != nil || r.code != exitOK {
			t.Fatalf("status %d, %v, stdout %q, stderr %q", r.code, err, r.stdout, r.stderr)
		}
		if len(hosts) != 1 || hosts[0].HostUUID != "host-c" {
			t.Fatalf("got %+v", hosts)
		}
	})

	t.Run("no hosts: an empty list, and a note on stderr", func(t *testing.T) {
		checkEmptyListing(t, ep, "hosts", "host")
	})
}

// checkEmptyListing checks that a listing command finding nothing under
// its prefix prints nothing but a note on stderr, and [] with -o json.
func checkEmptyListing(t *testing.T, ep, command, noun string) {
	t.Helper()
	r := runCoord(t, command, "--endpoints", ep, "--prefix", "/empty/")
	if r.code != exitOK || r.stdout != "" || !strings.Contains(r.stderr, "no "+noun+" under /empty/") {
		t.Fatalf("status %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCoord(t, command, "--endpoints", ep, "--prefix", "/empty/", "-o", "json")
	if r.code != exitOK || strings.TrimSpace(r.stdout) != "[]" {
		t.Fatalf("status %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
}
