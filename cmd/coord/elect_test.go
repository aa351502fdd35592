package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

func TestLeaderAndCampaign(t *testing.T) {
	t.Parallel()
	_, ep, cli := newEtcd(t)
	candidates := func(key string) int64 {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
		defer cancel()
		resp, err := cli.Get(ctx, key+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Count
	}

	t.Run("leader of an election nobody leads: status 1", func(t *testing.T) {
		r := runCoord(t, "leader", "/e/none", "--endpoints", ep)
		if r.code != exitError || !strings.Contains(r.stderr, "election /e/none has no leader") {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		if n := candidates("/e/none"); n != 0 {
			t.Fatalf("leader left %d keys behind", n)
		}
	})

	t.Run("campaign leads, leader names it, Ctrl-C resigns and the next in line leads", func(t *testing.T) {
		// Flags after the arguments, as etcdctl allows.
		a := startCoord(t, "campaign", "/e/sched", "alpha", "--endpoints", ep)
		a.waitOutput(t, a.stdout, `leading /e/sched as "alpha" (token `)
		r := runCoord(t, "leader", "/e/sched", "--endpoints", ep)
		if r.code != exitOK || r.stdout != "alpha\n" {
			t.Fatalf("leader: status %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
		}
		r = runCoord(t, "leader", "/e/sched", "--endpoints", ep, "-o", "json")
		var info leaderInfo
		if err := json.Unmarshal([]byte(r.stdout), &info); err != nil || r.code != exitOK {
			t.Fatalf("leader -o json: status %d, %v, stdout %q", r.code, err, r.stdout)
		}
		if info.Key != "/e/sched" || info.Identity != "alpha" || info.Token <= 0 || info.Lease == "" {
			t.Fatalf("leader -o json: %+v", info)
		}

		// beta's TTL is short, and stretched on a slow CPU: it leads to
		// the end (see TestSemaphoreAndAcquire).
		b := startCoord(t, "--endpoints", ep, "campaign", "--ttl", (2 * time.Second * scale).String(), "/e/sched", "beta")
		b.waitOutput(t, b.stderr, "campaigning")
		eventually(t, "beta in line", func() bool { return candidates("/e/sched") == 2 })
		ra := a.stop(t)
		if ra.code != exitOK || !strings.Contains(ra.stdout, "resigned from /e/sched") {
			t.Fatalf("alpha: status %d\nstdout:\n%s\nstderr:\n%s", ra.code, ra.stdout, ra.stderr)
		}
		// Resigning hands over at once, not after a TTL.
		b.waitOutput(t, b.stdout, `leading /e/sched as "beta"`)
		if r := runCoord(t, "leader", "/e/sched", "--endpoints", ep); r.stdout != "beta\n" {
			t.Fatalf("leader after the handover: %q, stderr %q", r.stdout, r.stderr)
		}

		// Interrupted while waiting in line: nothing left behind.
		g := startCoord(t, "--endpoints", ep, "campaign", "/e/sched", "gamma")
		g.waitOutput(t, g.stderr, `"beta" leads /e/sched: waiting in line`)
		eventually(t, "gamma in line", func() bool { return candidates("/e/sched") == 2 })
		rg := g.stop(t)
		if rg.code != exitOK || !strings.Contains(rg.stdout, "interrupted before leading") {
			t.Fatalf("gamma: status %d\nstdout:\n%s\nstderr:\n%s", rg.code, rg.stdout, rg.stderr)
		}
		if n := candidates("/e/sched"); n != 1 {
			t.Fatalf("%d candidates after gamma left, want beta only", n)
		}

		if rb := b.stop(t); rb.code != exitOK || !strings.Contains(rb.stdout, "resigned") {
			t.Fatalf("beta: status %d\nstdout:\n%s\nstderr:\n%s", rb.code, rb.stdout, rb.stderr)
		}
		if n := candidates("/e/sched"); n != 0 {
			t.Fatalf("%d candidate keys left after everyone resigned", n)
		}
	})

	t.Run("leadership lost: status 1", func(t *testing.T) {
		c := startCoord(t, "campaign", "/e/lost", "delta", "--endpoints", ep)
		c.waitOutput(t, c.stdout, "leading")
		// An operator deletes the leader key from under it.
		if _, err := cli.Delete(context.Background(), "/e/lost/", clientv3.WithPrefix()); err != nil {
			t.Fatal(err)
		}
		r := c.wait(t)
		if r.code != exitError || !strings.Contains(r.stderr, "coord: campaign in /e/lost: leadership lost: leader key deleted\n") {
			t.Fatalf("status %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
		}
	})
}
