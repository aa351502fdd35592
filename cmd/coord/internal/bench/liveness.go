package bench

import (
	"context"
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
	// Each host's samples are taken less the TTL its own lease was granted.
	c, p, ttl, err := benchCrashSides(ctx, env, cfg, func(side string, _ time.Duration) (benchCrashSamples, error) {
		return benchCrashDownSide(ctx, env, cfg, side)
	})
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

// benchCrashSides runs both sides of a crash scenario (1 or 4) at once,
// passing each the TTL etcd grants for cfg.crashTTL, and returns that TTL
// too: the rows compare latencies less it.
func benchCrashSides(ctx context.Context, env *benchEnv, cfg Config, side func(side string, ttl time.Duration) (benchCrashSamples, error)) (c, p benchCrashSamples, ttl time.Duration, err error) {
	if ttl, err = benchGrantedTTL(ctx, env.cli, cfg.crashTTL); err != nil {
		return c, p, 0, err
	}
	c, p, err = benchBoth(func(s string) (benchCrashSamples, error) { return side(s, ttl) })
	return c, p, ttl, err
}

// benchCrashSamples are the samples of a crash scenario: from the crash,
// and from the crashed client's last renewal, both minus the TTL.
type benchCrashSamples struct {
	fromCrash, fromRenewal benchLatencies
}

// add records crash c, seen (Down, or a successor leading) at seen, of a
// lease of ttl.
func (s *benchCrashSamples) add(seen time.Time, c benchCrash, ttl time.Duration) {
	s.fromCrash = append(s.fromCrash, seen.Sub(c.at)-ttl)
	s.fromRenewal = append(s.fromRenewal, seen.Sub(c.at)+c.renewed-ttl)
}

// benchCrashRenewalRow is the row that takes the renewal cadence out of a
// crash scenario: what is left is etcd's expiry check and the delivery.
func benchCrashRenewalRow(scenario string, c, p benchCrashSamples) benchRow {
	return benchLatencyRow(scenario+": measured from the last renewal the crashed client sent; latency − TTL, p50 / p99",
		c.fromRenewal, p.fromRenewal, 0,
		"0–500 ms: etcd's expiry check alone; the sides differ in the row above only by how recently they renewed")
}

// benchCrash is one crash: when the client was closed, and how long before
// that it had last sent a renewal.
type benchCrash struct {
	at      time.Time
	renewed time.Duration
}

// benchCrashClient crashes cli now: it is closed, nothing is revoked. cnt
// counts cli's renewals.
func benchCrashClient(cli *clientv3.Client, cnt *benchRPCCounter) benchCrash {
	at := time.Now()
	_ = cli.Close()
	renewed, _ := cnt.sinceRenewal(at)
	return benchCrash{at: at, renewed: renewed}
}

// benchAtRandom calls do(0) to do(n-1), in turn, at n moments drawn at
// random over span from now: crashes at every phase of etcd's expiry check
// and of the renewals.
func benchAtRandom(ctx context.Context, n int, span time.Duration, do func(i int)) error {
	off := make([]time.Duration, n)
	for i := range off {
		off[i] = rand.N(span)
	}
	benchSortDurations(off)
	start := time.Now()
	for i := range off {
		if err := benchSleep(ctx, time.Until(start.Add(off[i]))); err != nil {
			return err
		}
		do(i)
	}
	return nil
}

// benchStaggerSetup pauses at random before one of n setups, spreading
// them over about a second, as a fleet's hosts start at random moments:
// the etcd client renews on a 500 ms tick of its own, and its phase
// against etcd's 500 ms expiry check sets how late a crashed host's lease
// goes.
func benchStaggerSetup(ctx context.Context, n int) error {
	return benchSleep(ctx, rand.N(2*time.Second/time.Duration(n)))
}

// benchCrashHost is a host of scenario 1, on a client of its own.
type benchCrashHost struct {
	id      string
	cli     *clientv3.Client
	cnt     *benchRPCCounter // when the client last renewed
	ttl     time.Duration    // granted
	h       *coord.HostLiveness
	crashed benchCrash
}

// benchCrashDownSide registers cfg.crashHosts hosts, each on its own
// client, watches them, crashes them at random moments over cfg.crashSpan
// and returns, per host, the time from the crash to the watcher's Down
// minus the granted TTL.
func benchCrashDownSide(ctx context.Context, env *benchEnv, cfg Config, side string) (out benchCrashSamples, err error) {
	n := cfg.crashHosts
	prefix := env.prefix("crash", side)
	log := newBenchHostLog()
	stopWatch, err := benchStartWatch(ctx, env, side, prefix, log)
	if err != nil {
		return out, err
	}
	defer stopWatch()
	hosts := make([]benchCrashHost, n)
	defer func() {
		for _, h := range hosts {
			h.close()
		}
	}()
	for i := range hosts {
		if err := benchStaggerSetup(ctx, n); err != nil {
			return out, err
		}
		if hosts[i], err = benchNewCrashHost(ctx, env, cfg, side, prefix, i); err != nil {
			return out, err
		}
	}
	if err := log.waitUps(ctx, n); err != nil {
		return out, err
	}
	// Let renewals run for a while, so that each host crashes at a random
	// point of its renewal cycle.
	if err := benchSleep(ctx, 3*cfg.crashTTL/2); err != nil {
		return out, err
	}
	if err := benchAtRandom(ctx, n, cfg.crashSpan, func(i int) { hosts[i].crashed = benchCrashClient(hosts[i].cli, hosts[i].cnt) }); err != nil {
		return out, err
	}
	if err := log.wait(ctx, cfg.crashTTL+10*time.Second, "Down of every crashed host", func() bool { return len(log.down) == n }); err != nil {
		return out, err
	}
	for _, h := range hosts {
		at, _ := log.downAt(h.id)
		out.add(at, h.crashed, h.ttl)
	}
	return out, nil
}

// benchNewCrashHost registers host i of side under prefix, on a client of
// its own. What it returns is to be closed also after an error.
func benchNewCrashHost(ctx context.Context, env *benchEnv, cfg Config, side, prefix string, i int) (h benchCrashHost, err error) {
	m := benchMeta(side, i)
	h = benchCrashHost{id: m.HostUUID, cnt: &benchRPCCounter{}}
	if h.cli, err = env.client(h.cnt.dialOptions()...); err != nil {
		return h, err
	}
	if side == "coord" {
		if h.h, err = coord.RegisterHostLiveness(ctx, h.cli, m, coord.LivenessOptions{Prefix: prefix, TTL: cfg.crashTTL}); err != nil {
			return h, err
		}
		h.ttl = h.h.TTL()
		return h, nil
	}
	_, h.ttl, err = benchPlainRegister(ctx, context.Background(), h.cli, prefix+m.HostUUID, m, cfg.crashTTL)
	return h, err
}

func (h benchCrashHost) close() {
	if h.h != nil {
		_ = h.h.Stop(context.Background()) // its client is closed: ends at once
	}
	if h.cli != nil {
		_ = h.cli.Close() // on an early return, the hosts not crashed yet
	}
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
	s := &benchStopRun{cli: hostCli, cprefix: env.prefix("stop", "coord"), pprefix: env.prefix("stop", "plain"),
		clog: newBenchHostLog(), plog: newBenchHostLog()}
	stopC, err := benchStartWatch(ctx, env, "coord", s.cprefix, s.clog)
	if err != nil {
		return nil, err
	}
	defer stopC()
	stopP, err := benchStartWatch(ctx, env, "plain", s.pprefix, s.plog)
	if err != nil {
		return nil, err
	}
	defer stopP()
	defer s.close()
	if err := s.register(ctx, n); err != nil {
		return nil, err
	}
	var c, p benchLatencies
	for i := range n {
		dc, err := s.stopCoord(ctx, i)
		if err != nil {
			return nil, err
		}
		dp, err := s.stopPlain(ctx, i)
		if err != nil {
			return nil, err
		}
		c, p = append(c, dc), append(p, dp)
	}
	return []benchRow{benchLatencyRow(
		fmt.Sprintf("2. Stop → Down at a watcher (graceful): %d hosts; coord Stop vs plain Revoke + watch, p50 / p99", n),
		c, p, 0, "one Revoke round trip + the watch event: the plain column")}, nil
}

// benchStopRun is the hosts of scenario 2, all on one client: coord's under
// cprefix, followed in clog, and the plain ones under pprefix, in plog.
type benchStopRun struct {
	cli              *clientv3.Client
	cprefix, pprefix string
	clog, plog       *benchHostLog
	chosts           []*coord.HostLiveness
	phosts           []benchStopPlainHost
}

type benchStopPlainHost struct {
	id     string
	lease  clientv3.LeaseID
	cancel context.CancelFunc // ends the renewals
}

// register registers n hosts on each side, and waits for their Ups.
func (s *benchStopRun) register(ctx context.Context, n int) error {
	for i := range n {
		h, err := coord.RegisterHostLiveness(ctx, s.cli, benchMeta("coord", i), coord.LivenessOptions{Prefix: s.cprefix})
		if err != nil {
			return err
		}
		s.chosts = append(s.chosts, h)

		m := benchMeta("plain", i)
		kctx, cancel := context.WithCancel(context.Background())
		s.phosts = append(s.phosts, benchStopPlainHost{id: m.HostUUID, cancel: cancel})
		if s.phosts[i].lease, _, err = benchPlainRegister(ctx, kctx, s.cli, s.pprefix+m.HostUUID, m, coord.DefaultLivenessTTL); err != nil {
			return err
		}
	}
	if err := s.clog.waitUps(ctx, n); err != nil {
		return err
	}
	return s.plog.waitUps(ctx, n)
}

// stopCoord stops coord's host i, and returns how long its watcher took to
// see it Down: Stop revokes the lease.
func (s *benchStopRun) stopCoord(ctx context.Context, i int) (time.Duration, error) {
	id := s.chosts[i].Key()[len(s.cprefix):]
	t0 := time.Now()
	if err := s.chosts[i].Stop(ctx); err != nil {
		return 0, err
	}
	at, err := s.clog.waitDown(ctx, id, "Down after Stop")
	return at.Sub(t0), err
}

// stopPlain stops the plain host i as a user would, Revoke and no more
// renewals, and returns how long its watcher took to see it Down.
func (s *benchStopRun) stopPlain(ctx context.Context, i int) (time.Duration, error) {
	h := s.phosts[i]
	t0 := time.Now()
	if _, err := s.cli.Revoke(ctx, h.lease); err != nil {
		return 0, err
	}
	h.cancel()
	at, err := s.plog.waitDown(ctx, h.id, "Down after Revoke")
	return at.Sub(t0), err
}

func (s *benchStopRun) close() {
	for _, h := range s.chosts {
		_ = h.Stop(context.Background())
	}
	for _, h := range s.phosts {
		h.cancel()
	}
}
