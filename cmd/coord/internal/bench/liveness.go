package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// benchCrashDown measures scenario 1: hosts crash (their client is closed,
// nothing is revoked) and a watcher on another client sees them Down once
// etcd expires their leases. Samples are crash → Down minus the granted
// TTL. Both sides run at once: they mostly wait on etcd's clock.
func benchCrashDown(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	n := cfg.crashHosts
	ttl, err := benchGrantedTTL(ctx, env.cli, cfg.crashTTL)
	if err != nil {
		return nil, err
	}
	c, p, err := benchBoth(
		func() (benchCrashSamples, error) { return benchCrashDownSide(ctx, env, cfg, "coord", n) },
		func() (benchCrashSamples, error) { return benchCrashDownSide(ctx, env, cfg, "plain", n) },
	)
	if err != nil {
		return nil, err
	}
	return []benchRow{
		benchLatencyRow(
			fmt.Sprintf("1. Crash → Down at a watcher: %d hosts crashed (client closed, no revoke), TTL %s; latency − TTL, p50 / p99", n, benchSecs(ttl)),
			c.fromCrash, p.fromCrash, ttl,
			"≤ 500 ms: etcd checks for expired leases every 500 ms (aim: p99 ≤ TTL + 600 ms); "+
				"< 0 possible: a lease renewed t before the crash expires t early"),
		benchCrashRenewalRow("1b. Crash → Down, same hosts", c, p),
	}, nil
}

// benchCrashSamples are the samples of a crash scenario: from the crash,
// and from the crashed client's last renewal, both minus the TTL.
type benchCrashSamples struct {
	fromCrash, fromRenewal benchLatencies
}

// benchCrashRenewalRow is the row that takes the renewal cadence out of a
// crash scenario: what is left is etcd's expiry check and the delivery.
func benchCrashRenewalRow(scenario string, c, p benchCrashSamples) benchRow {
	return benchLatencyRow(scenario+": measured from the last renewal the crashed client sent; latency − TTL, p50 / p99",
		c.fromRenewal, p.fromRenewal, 0,
		"0–500 ms: etcd's expiry check alone; the sides differ in the row above only by how recently they renewed")
}

// benchCrashDownSide registers n hosts, each on its own client, watches them,
// crashes them at random moments over cfg.crashSpan and returns, per host,
// the time from the crash to the watcher's Down minus the granted TTL.
func benchCrashDownSide(ctx context.Context, env *benchEnv, cfg Config, side string, n int) (out benchCrashSamples, err error) {
	prefix := env.prefix("crash", side)
	log := newBenchHostLog()
	stopWatch, err := benchStartWatch(ctx, env, side, prefix, log)
	if err != nil {
		return out, err
	}
	defer stopWatch()

	type host struct {
		id  string
		cli *clientv3.Client
		cnt *benchRPCCounter // when the client last renewed
		ttl time.Duration
		h   *coord.HostLiveness // coord side
	}
	hosts := make([]host, n)
	defer func() {
		for _, h := range hosts {
			if h.h != nil {
				_ = h.h.Stop(context.Background()) // its client is closed: ends at once
			}
			if h.cli != nil {
				_ = h.cli.Close() // on an early return, the hosts not crashed yet
			}
		}
	}()
	for i := range hosts {
		// Spread the setups over about a second, as a fleet's hosts start
		// at random moments: the etcd client renews on a 500 ms tick of
		// its own, and its phase against etcd's 500 ms expiry check sets
		// how late a crashed host's lease goes.
		if err := benchSleep(ctx, rand.N(2*time.Second/time.Duration(n))); err != nil {
			return out, err
		}
		m := benchMeta(side, i)
		cnt := &benchRPCCounter{}
		c, err := env.client(cnt.dialOptions()...)
		if err != nil {
			return out, err
		}
		hosts[i] = host{id: m.HostUUID, cli: c, cnt: cnt}
		if side == "coord" {
			h, err := coord.RegisterHostLiveness(ctx, c, m, coord.LivenessOptions{Prefix: prefix, TTL: cfg.crashTTL})
			if err != nil {
				return out, err
			}
			hosts[i].h, hosts[i].ttl = h, h.TTL()
			continue
		}
		// What a user writes: a lease, kept alive, and the key on it.
		g, err := c.Grant(ctx, int64(cfg.crashTTL/time.Second))
		if err != nil {
			return out, err
		}
		ka, err := c.KeepAlive(context.Background(), g.ID) // until the client closes
		if err != nil {
			return out, err
		}
		go func() {
			for range ka {
			}
		}()
		if _, err := c.Put(ctx, prefix+m.HostUUID, benchValue(m), clientv3.WithLease(g.ID)); err != nil {
			return out, err
		}
		hosts[i].ttl = time.Duration(g.TTL) * time.Second
	}
	if err := log.wait(ctx, 30*time.Second, "Up of every host", func() bool { return len(log.up) == n }); err != nil {
		return out, err
	}
	// Let renewals run for a while, so that each host crashes at a random
	// point of its renewal cycle.
	if err := benchSleep(ctx, 3*cfg.crashTTL/2); err != nil {
		return out, err
	}
	crashed := make([]time.Time, n)
	renewed := make([]time.Duration, n) // before the crash
	start := time.Now()
	for i, off := range benchCrashOffsets(n, cfg.crashSpan) {
		if err := benchSleep(ctx, time.Until(start.Add(off))); err != nil {
			return out, err
		}
		crashed[i] = time.Now()
		_ = hosts[i].cli.Close()
		renewed[i], _ = hosts[i].cnt.sinceRenewal(crashed[i])
	}
	timeout := cfg.crashTTL + 10*time.Second
	if err := log.wait(ctx, timeout, "Down of every crashed host", func() bool { return len(log.down) == n }); err != nil {
		return out, err
	}
	for i, h := range hosts {
		at, _ := log.downAt(h.id)
		out.fromCrash = append(out.fromCrash, at.Sub(crashed[i])-h.ttl)
		out.fromRenewal = append(out.fromRenewal, at.Sub(crashed[i])+renewed[i]-h.ttl)
	}
	return out, nil
}

// benchStartWatch watches prefix with coord's watcher or with plain Get+Watch,
// recording Up and Down events in log.
func benchStartWatch(ctx context.Context, env *benchEnv, side, prefix string, log *benchHostLog) (func(), error) {
	if side == "coord" {
		return benchWatchCoord(ctx, env.cli, prefix, func(ev coord.HostEvent) { log.add(ev.Kind, ev.HostUUID, time.Now()) })
	}
	_, stop, err := benchPlainWatch(ctx, env.cli, prefix, func(kind coord.HostEventKind, id string, _ int64, at time.Time) {
		log.add(kind, id, at)
	})
	return stop, err
}

// benchStopDown measures scenario 2: a host stops gracefully and the
// watcher sees it Down. coord's Stop against a plain Revoke; one host at a
// time, the two sides alternating.
func benchStopDown(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	n := cfg.stopHosts
	hostCli, err := env.client()
	if err != nil {
		return nil, err
	}
	cprefix, pprefix := env.prefix("stop", "coord"), env.prefix("stop", "plain")
	clog, plog := newBenchHostLog(), newBenchHostLog()
	stopC, err := benchStartWatch(ctx, env, "coord", cprefix, clog)
	if err != nil {
		return nil, err
	}
	defer stopC()
	stopP, err := benchStartWatch(ctx, env, "plain", pprefix, plog)
	if err != nil {
		return nil, err
	}
	defer stopP()

	type plainHost struct {
		id     string
		lease  clientv3.LeaseID
		cancel context.CancelFunc
	}
	chosts := make([]*coord.HostLiveness, 0, n)
	phosts := make([]plainHost, 0, n)
	defer func() {
		for _, h := range chosts {
			_ = h.Stop(context.Background())
		}
		for _, h := range phosts {
			h.cancel()
		}
	}()
	for i := range n {
		m := benchMeta("coord", i)
		h, err := coord.RegisterHostLiveness(ctx, hostCli, m, coord.LivenessOptions{Prefix: cprefix})
		if err != nil {
			return nil, err
		}
		chosts = append(chosts, h)

		m = benchMeta("plain", i)
		g, err := hostCli.Grant(ctx, int64(coord.DefaultLivenessTTL/time.Second))
		if err != nil {
			return nil, err
		}
		kctx, cancel := context.WithCancel(context.Background())
		phosts = append(phosts, plainHost{id: m.HostUUID, lease: g.ID, cancel: cancel})
		ka, err := hostCli.KeepAlive(kctx, g.ID)
		if err != nil {
			return nil, err
		}
		go func() {
			for range ka {
			}
		}()
		if _, err := hostCli.Put(ctx, pprefix+m.HostUUID, benchValue(m), clientv3.WithLease(g.ID)); err != nil {
			return nil, err
		}
	}
	if err := clog.wait(ctx, 30*time.Second, "Up of every host", func() bool { return len(clog.up) == n }); err != nil {
		return nil, err
	}
	if err := plog.wait(ctx, 30*time.Second, "Up of every host", func() bool { return len(plog.up) == n }); err != nil {
		return nil, err
	}
	var c, p benchLatencies
	for i := range n {
		// coord: Stop revokes the lease.
		id := chosts[i].Key()[len(cprefix):]
		t0 := time.Now()
		if err := chosts[i].Stop(ctx); err != nil {
			return nil, err
		}
		if err := clog.wait(ctx, 10*time.Second, "Down after Stop", func() bool { _, ok := clog.down[id]; return ok }); err != nil {
			return nil, err
		}
		at, _ := clog.downAt(id)
		c = append(c, at.Sub(t0))

		// plain: Revoke, and stop renewing.
		t0 = time.Now()
		if _, err := hostCli.Revoke(ctx, phosts[i].lease); err != nil {
			return nil, err
		}
		phosts[i].cancel()
		if err := plog.wait(ctx, 10*time.Second, "Down after Revoke", func() bool { _, ok := plog.down[phosts[i].id]; return ok }); err != nil {
			return nil, err
		}
		at, _ = plog.downAt(phosts[i].id)
		p = append(p, at.Sub(t0))
	}
	if len(c) != n || len(p) != n {
		return nil, errors.New("bench: samples missing")
	}
	return []benchRow{benchLatencyRow(
		fmt.Sprintf("2. Stop → Down at a watcher (graceful): %d hosts; coord Stop vs plain Revoke + watch, p50 / p99", n),
		c, p, 0, "one Revoke round trip + the watch event: the plain column")}, nil
}
