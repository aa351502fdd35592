package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

func TestSemaphoreAndAcquire(t *testing.T) {
	t.Parallel()
	_, ep, cli := newEtcd(t)
	permits := func(key string) int64 {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
		defer cancel()
		resp, err := cli.Get(ctx, key+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Count
	}
	list := func(key string) semaphoreInfo {
		t.Helper()
		r := runCoord(t, "semaphore", key, "--endpoints", ep, "-o", "json")
		var info semaphoreInfo
		if err := json.Unmarshal([]byte(r.stdout), &info); err != nil || r.code != exitOK {
			t.Fatalf("semaphore -o json: status %d, %v, stdout %q, stderr %q", r.code, err, r.stdout, r.stderr)
		}
		return info
	}
	identities := func(ps []permitInfo) string {
		var ids []string
		for _, p := range ps {
			ids = append(ids, p.Identity)
		}
		return strings.Join(ids, ",")
	}

	t.Run("semaphore of a key nobody used: status 1", func(t *testing.T) {
		r := runCoord(t, "semaphore", "/s/none", "--endpoints", ep)
		if r.code != exitError || !strings.Contains(r.stderr, "semaphore /s/none holds no limit") {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
	})

	t.Run("a key that holds no limit: status 1", func(t *testing.T) {
		if _, err := cli.Put(context.Background(), "/s/junk", "many"); err != nil {
			t.Fatal(err)
		}
		r := runCoord(t, "semaphore", "/s/junk", "--endpoints", ep)
		if r.code != exitError || !strings.Contains(r.stderr, `its key holds "many", not a limit`) {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
	})

	t.Run("acquire holds, semaphore lists holders and waiters, Ctrl-C releases to the next in line", func(t *testing.T) {
		a := startCoord(t, "acquire", "/s/maint", "alpha", "--limit", "2", "--endpoints", ep)
		a.waitOutput(t, a.stdout, `holding a permit of /s/maint as "alpha" (token `)
		// beta's TTL is short, and stretched on a slow CPU: it holds to
		// the end (on riscv64 under emulation, its 2 s lease expired, and
		// the next in line took its permit instead of waiting).
		b := startCoord(t, "--endpoints", ep, "acquire", "--limit", "2", "--ttl", (2 * time.Second * scale).String(), "/s/maint", "beta")
		b.waitOutput(t, b.stdout, `holding a permit of /s/maint as "beta"`)
		g := startCoord(t, "--endpoints", ep, "acquire", "--limit", "2", "/s/maint", "gamma")
		g.waitOutput(t, g.stderr, "acquiring")
		eventually(t, "gamma in line", func() bool { return permits("/s/maint") == 3 })

		info := list("/s/maint")
		if info.Key != "/s/maint" || info.Limit != 2 || identities(info.Holders) != "alpha,beta" || identities(info.Waiters) != "gamma" ||
			info.Holders[0].Token >= info.Holders[1].Token || info.Holders[0].Lease == "" {
			t.Fatalf("semaphore -o json: %+v", info)
		}
		r := runCoord(t, "semaphore", "/s/maint", "--endpoints", ep)
		if r.code != exitOK || !strings.Contains(r.stdout, "limit 2, 2 held, 1 waiting") ||
			!strings.Contains(r.stdout, "holder   alpha") || !strings.Contains(r.stdout, "waiting  gamma") {
			t.Fatalf("semaphore: status %d, stdout:\n%s\nstderr: %s", r.code, r.stdout, r.stderr)
		}

		// Another limit is refused, and leaves nothing.
		r = runCoord(t, "acquire", "/s/maint", "delta", "--limit", "3", "--endpoints", ep)
		if r.code != exitError || !strings.Contains(r.stderr, "limit mismatch") {
			t.Fatalf("acquire with another limit: status %d, stderr %q", r.code, r.stderr)
		}

		ra := a.stop(t)
		if ra.code != exitOK || !strings.Contains(ra.stdout, "released a permit of /s/maint") {
			t.Fatalf("alpha: status %d\nstdout:\n%s\nstderr:\n%s", ra.code, ra.stdout, ra.stderr)
		}
		// Releasing hands over at once, not after a TTL.
		g.waitOutput(t, g.stdout, `holding a permit of /s/maint as "gamma"`)
		if info := list("/s/maint"); identities(info.Holders) != "beta,gamma" || len(info.Waiters) != 0 {
			t.Fatalf("after the handover: %+v", info)
		}

		// Interrupted while waiting in line: nothing left behind.
		d := startCoord(t, "--endpoints", ep, "acquire", "--limit", "2", "/s/maint")
		d.waitOutput(t, d.stderr, "acquiring")
		eventually(t, "the host in line", func() bool { return permits("/s/maint") == 3 })
		rd := d.stop(t)
		if rd.code != exitOK || !strings.Contains(rd.stdout, "interrupted before acquiring") {
			t.Fatalf("interrupted: status %d\nstdout:\n%s\nstderr:\n%s", rd.code, rd.stdout, rd.stderr)
		}
		for _, c := range []*bgCoord{b, g} {
			if r := c.stop(t); r.code != exitOK || !strings.Contains(r.stdout, "released") {
				t.Fatalf("status %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
			}
		}
		if n := permits("/s/maint"); n != 0 {
			t.Fatalf("%d permit keys left after everyone released", n)
		}
	})

	t.Run("permit lost: status 1", func(t *testing.T) {
		c := startCoord(t, "acquire", "/s/lost", "epsilon", "--limit", "1", "--endpoints", ep)
		c.waitOutput(t, c.stdout, "holding")
		// An operator deletes the permit key from under it.
		if _, err := cli.Delete(context.Background(), "/s/lost/", clientv3.WithPrefix()); err != nil {
			t.Fatal(err)
		}
		r := c.wait(t)
		if r.code != exitError || !strings.Contains(r.stderr, "coord: acquire /s/lost: permit lost: permit key deleted\n") {
			t.Fatalf("status %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
		}
	})
}
