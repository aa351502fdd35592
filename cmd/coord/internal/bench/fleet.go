package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// benchFleetWorkers is how many campaigns each agent of scenario 9 has in
// flight at once while it takes its keys.
const benchFleetWorkers = 4

// benchFleetResult is what one side of scenario 9 cost.
type benchFleetResult struct {
	setup      time.Duration // until every agent led all its keys
	leases     int64         // held once set up: etcd's count, or the agents' grants − revokes
	etcdLeases bool          // leases is etcd's own count
	keys       int64         // under the side's prefix, once set up
	renewals   float64       // LeaseKeepAlive requests sent per second, over the window

	agentsCPU, agentsIdleCPU float64 // this process, ms per s: during the window, before the agents
	cpuOK                    bool

	cluster                    bool    // the cluster is ours: its figures below are measured
	clusterCPU, clusterIdleCPU float64 // ms per s: during the window, before the agents
	clusterCPUOK               bool
	clusterMem, clusterIdleMem benchClusterStat // after a gc: at the end of the window, before the agents
	clusterPeak                int64            // bytes: peak RSS, setup included
}

// benchFleet measures scenario 9: a fleet of agents, each on its own
// client, each leading its share of the keys, on a cluster of its own per
// side (an embedded one in a child process, unless --endpoints names one).
// coord: a HostLiveness and an ElectionPool on its lease per agent. plain: Grant +
// KeepAlive + Put per agent, and a concurrency session per key (a lease
// per key). The sides run one after the other.
func benchFleet(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	c, p, err := benchInTurn(ctx, env, func(side string) (benchFleetResult, error) { return benchFleetSide(ctx, env, cfg, side) })
	if err != nil {
		return nil, err
	}
	return append(benchFleetRows(cfg, c, p), benchFleetCostRows(env, cfg, c, p)...), nil
}

// benchFleetRows are the rows of what the fleet asks of etcd.
func benchFleetRows(cfg Config, c, p benchFleetResult) []benchRow {
	where := fmt.Sprintf("a %d-member embedded cluster in a child process, one per side", cfg.fleetMembers)
	if !c.cluster {
		where = "the cluster of --endpoints"
	}
	leasesBy := "etcd's count"
	if !c.etcdLeases {
		leasesBy = "granted − revoked by the agents"
	}
	// With Host, the first KeysPerSession elections of an agent ride its
	// registration's lease, the others sessions of the pool's own.
	sessions := benchPoolSessions(cfg.fleetKeys / cfg.fleetAgents)
	rate := float64(cfg.fleetAgents) * (float64(sessions-1)*3/cfg.fleetPoolTTL.Seconds() + 3/cfg.fleetLivenessTTL.Seconds())
	return []benchRow{
		{
			scenario: fmt.Sprintf("9. Fleet: %d agents, each on its own client, each leading %s of %s keys (liveness TTL %s; coord: the elections ride the registration's lease, PoolOptions.Host; plain: sessions of TTL %s), on %s: leases held (%s)",
				cfg.fleetAgents, benchCount(cfg.fleetKeys/cfg.fleetAgents), benchCount(cfg.fleetKeys),
				benchSecs(cfg.fleetLivenessTTL), benchSecs(cfg.fleetPoolTTL), where, leasesBy),
			coord: benchCount(int(c.leases)),
			plain: benchCount(int(p.leases)),
			ratio: benchRatio(float64(c.leases), float64(p.leases), "leases"),
			limit: fmt.Sprintf("%s: one lease per agent, its registration's (and one per further %s keys); plain: a lease per key",
				benchCount(cfg.fleetAgents*sessions), benchCount(coord.DefaultKeysPerSession)),
		},
		{
			scenario: "9. Fleet, same: keys under the fleet's prefix",
			coord:    benchCount(int(c.keys)),
			plain:    benchCount(int(p.keys)),
			ratio:    benchRatio(float64(c.keys), float64(p.keys), "keys"),
			limit:    fmt.Sprintf("%s: a candidate key per election and a key per host", benchCount(cfg.fleetKeys+cfg.fleetAgents)),
		},
		{
			scenario: fmt.Sprintf("9. Fleet, same: LeaseKeepAlive requests/s over %s", benchSecs(cfg.fleetWindow)),
			coord:    fmt.Sprintf("%.1f/s", c.renewals),
			plain:    fmt.Sprintf("%.1f/s", p.renewals),
			ratio:    benchRatio(c.renewals, p.renewals, "requests/s"),
			limit:    fmt.Sprintf("%.1f/s: each lease every TTL/3", rate),
		},
		{
			scenario: fmt.Sprintf("9. Fleet, same: time until every agent leads all its keys (%d campaigns in flight per agent)", benchFleetWorkers),
			coord:    fmt.Sprintf("%.1f s", c.setup.Seconds()),
			plain:    fmt.Sprintf("%.1f s", p.setup.Seconds()),
			ratio:    benchRatio(c.setup.Seconds(), p.setup.Seconds(), "time"),
			limit:    "plain: a Grant per key on top of each campaign",
		},
	}
}

// benchFleetCostRows are the rows of the CPU time and memory of the
// cluster and of the agents, where they could be measured.
func benchFleetCostRows(env *benchEnv, cfg Config, c, p benchFleetResult) []benchRow {
	mb := func(b int64) string { return fmt.Sprintf("%.0f MB", float64(b)/1e6) }
	var rows []benchRow
	if c.clusterCPUOK && p.clusterCPUOK {
		rows = append(rows, benchRow{
			scenario: fmt.Sprintf("9. Fleet, same: CPU of the cluster's process (its %d members, nothing else) during the window, ms per s", cfg.fleetMembers),
			coord:    fmt.Sprintf("%.0f ms/s", c.clusterCPU),
			plain:    fmt.Sprintf("%.0f ms/s", p.clusterCPU),
			ratio:    benchRatio(c.clusterCPU, p.clusterCPU, "CPU"),
			limit:    fmt.Sprintf("idle, before the agents: %.0f / %.0f ms/s", c.clusterIdleCPU, p.clusterIdleCPU),
		})
	}
	if c.cluster && p.cluster && c.clusterMem.heap > 0 && p.clusterMem.heap > 0 {
		peak := ""
		if c.clusterPeak > 0 && p.clusterPeak > 0 {
			peak = fmt.Sprintf("; peak RSS, setup included: %s / %s", mb(c.clusterPeak), mb(p.clusterPeak))
		}
		rss := func(r benchFleetResult) string {
			if r.clusterMem.rss == 0 {
				return ""
			}
			return ", RSS " + mb(r.clusterMem.rss)
		}
		rows = append(rows, benchRow{
			scenario: "9. Fleet, same: memory of the cluster's process at the end of the window, after a GC that gives freed memory back: live Go heap (and RSS)",
			coord:    mb(c.clusterMem.heap) + rss(c),
			plain:    mb(p.clusterMem.heap) + rss(p),
			ratio:    benchRatio(float64(c.clusterMem.heap), float64(p.clusterMem.heap), "heap"),
			limit: fmt.Sprintf("idle, before the agents: heap %s / %s, RSS %s / %s%s",
				mb(c.clusterIdleMem.heap), mb(p.clusterIdleMem.heap), mb(c.clusterIdleMem.rss), mb(p.clusterIdleMem.rss), peak),
		})
	}
	if c.cpuOK && p.cpuOK {
		what := "the agents' clients"
		if env.embedded {
			what += " and the idle embedded etcd of rows 1–8"
		}
		rows = append(rows, benchRow{
			scenario: fmt.Sprintf("9. Fleet, same: CPU of this process (%s) during the window, ms per s", what),
			coord:    fmt.Sprintf("%.0f ms/s", c.agentsCPU),
			plain:    fmt.Sprintf("%.0f ms/s", p.agentsCPU),
			ratio:    benchRatio(c.agentsCPU, p.agentsCPU, "CPU"),
			limit:    fmt.Sprintf("before the agents: %.0f / %.0f ms/s", c.agentsIdleCPU, p.agentsIdleCPU),
		})
	}
	return rows
}

// benchFleetSide runs one side of scenario 9 on a cluster of its own (or
// the cluster of --endpoints).
func benchFleetSide(ctx context.Context, env *benchEnv, cfg Config, side string) (r benchFleetResult, err error) {
	base := env.base
	var cl *benchCluster
	if env.embedded {
		if cl, err = startBenchCluster(ctx, cfg.fleetMembers); err != nil {
			return r, err
		}
		defer func() { err = errors.Join(err, cl.close()) }()
		base.Endpoints = cl.endpoints
		r.cluster = true
	}
	books, err := env.clientOf(base)
	if err != nil {
		return r, err
	}
	defer books.Close()
	m, err := startBenchMeter(ctx, cl, min(cfg.fleetWindow/4, 3*time.Second))
	if err == nil {
		r.agentsIdleCPU, r.clusterIdleCPU, r.clusterIdleMem, err = m.read()
	}
	if err != nil {
		return r, err
	}

	var cnt benchRPCCounter
	prefix := env.prefix("fleet", side)
	agents := make([]*benchFleetAgent, cfg.fleetAgents)
	defer func() { benchFleetStop(ctx, agents, cl != nil) }()
	t := time.Now()
	if err := benchParallel(ctx, cfg.fleetAgents, cfg.fleetAgents, func(a int) error {
		cli, err := env.clientOf(base, cnt.dialOptions()...)
		if err != nil {
			return err
		}
		agents[a] = &benchFleetAgent{cli: cli}
		return agents[a].start(ctx, side, cfg, prefix, a)
	}); err != nil {
		return r, err
	}
	r.setup = time.Since(t)
	env.progress("scenario 9 (%s): %d agents lead %s keys after %v; counting for %v",
		side, cfg.fleetAgents, benchCount(cfg.fleetKeys), r.setup.Round(time.Millisecond), cfg.fleetWindow)
	// Count once the registrations' first renewals are out: a renewal
	// stream opened then is part of starting up.
	if err := benchSleep(ctx, time.Until(t.Add(cfg.fleetLivenessTTL/3+500*time.Millisecond))); err != nil {
		return r, err
	}
	return r, r.measure(ctx, cfg, cl, books, &cnt, prefix)
}

// measure counts, once the fleet is set up, the leases and keys it holds,
// then its renewals and the CPU time and memory over the window.
func (r *benchFleetResult) measure(ctx context.Context, cfg Config, cl *benchCluster, books *clientv3.Client, cnt *benchRPCCounter, prefix string) (err error) {
	if r.leases, r.keys, r.etcdLeases, err = benchFleetCount(ctx, books, prefix, cl != nil); err != nil {
		return err
	}
	if !r.etcdLeases {
		r.leases = cnt.grants.Load() - cnt.revokes.Load()
	}
	ka0 := cnt.keepAlives.Load()
	m, err := startBenchMeter(ctx, cl, cfg.fleetWindow)
	if err != nil {
		return err
	}
	r.renewals = float64(cnt.keepAlives.Load()-ka0) / cfg.fleetWindow.Seconds()
	r.agentsCPU, r.clusterCPU, r.clusterMem, err = m.read()
	r.cpuOK, r.clusterCPUOK, r.clusterPeak = m.cpuOK, m.clusterCPUOK, r.clusterMem.peak
	return err
}

// benchMeter measures, over a span, the CPU time of this process and of
// the cluster's, when it is ours.
type benchMeter struct {
	cl                  *benchCluster
	span                time.Duration
	cpu, clusterCPU     time.Duration // at the start
	cpuOK, clusterCPUOK bool
}

// startBenchMeter starts measuring, and waits out the span.
func startBenchMeter(ctx context.Context, cl *benchCluster, span time.Duration) (*benchMeter, error) {
	m := &benchMeter{cl: cl, span: span}
	m.cpu, m.cpuOK = benchProcessCPU()
	if cl != nil {
		st, err := cl.stat()
		if err != nil {
			return nil, err
		}
		m.clusterCPU, m.clusterCPUOK = st.cpu, st.cpu > 0
	}
	return m, benchSleep(ctx, span)
}

// read returns the CPU time, in ms per s, this process and the cluster's
// used over the span, and then the cluster's memory once it has collected
// its garbage (with the peak RSS it had before).
func (m *benchMeter) read() (cpu, clusterCPU float64, mem benchClusterStat, err error) {
	now, _ := benchProcessCPU()
	cpu = benchMsPerSec(now-m.cpu, m.span)
	if m.cl == nil {
		return cpu, 0, mem, nil
	}
	st, err := m.cl.stat()
	if err != nil {
		return cpu, 0, mem, err
	}
	clusterCPU = benchMsPerSec(st.cpu-m.clusterCPU, m.span)
	if mem, err = m.cl.gc(); err != nil {
		return cpu, clusterCPU, mem, err
	}
	mem.peak = st.peak
	return cpu, clusterCPU, mem, nil
}

// benchFleetCount counts the keys under prefix and, on a cluster of our
// own, the leases etcd holds.
func benchFleetCount(ctx context.Context, cli *clientv3.Client, prefix string, ours bool) (leases, keys int64, etcdLeases bool, err error) {
	g, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return 0, 0, false, fmt.Errorf("bench: counting keys: %w", err)
	}
	if !ours {
		return 0, g.Count, false, nil
	}
	l, err := cli.Leases(ctx)
	if err != nil {
		return 0, 0, false, fmt.Errorf("bench: counting leases: %w", err)
	}
	return int64(len(l.Leases)), g.Count, true, nil
}

func benchMsPerSec(d, over time.Duration) float64 {
	return float64(d) / float64(time.Millisecond) / over.Seconds()
}

// benchFleetAgent is one agent of scenario 9: a host on its own client,
// leading its share of the keys.
type benchFleetAgent struct {
	cli *clientv3.Client

	// coord
	host *coord.HostLiveness
	pool *coord.ElectionPool
	// plain
	lease    clientv3.LeaseID
	cancel   context.CancelFunc
	mu       sync.Mutex
	sessions []*concurrency.Session
}

// start registers agent a of side under prefix and campaigns for its keys.
func (a *benchFleetAgent) start(ctx context.Context, side string, cfg Config, prefix string, n int) error {
	m := benchMeta(side, n)
	per := cfg.fleetKeys / cfg.fleetAgents
	key := func(i int) string { return fmt.Sprintf("%selections/%05d", prefix, n*per+i) }
	var err error
	if side == "coord" {
		if a.host, err = coord.RegisterHostLiveness(ctx, a.cli, m, coord.LivenessOptions{Prefix: prefix + "hosts/", TTL: cfg.fleetLivenessTTL}); err != nil {
			return err
		}
		if a.pool, err = coord.NewElectionPool(a.cli, coord.PoolOptions{TTL: cfg.fleetPoolTTL, Identity: m.Hostname, Host: a.host}); err != nil {
			return err
		}
		return benchParallel(ctx, per, benchFleetWorkers, func(i int) error {
			e, err := a.pool.Election(ctx, key(i))
			if err != nil {
				return err
			}
			return e.Campaign(ctx, "")
		})
	}
	kctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	if a.lease, _, err = benchPlainRegister(ctx, kctx, a.cli, prefix+"hosts/"+m.HostUUID, m, cfg.fleetLivenessTTL); err != nil {
		return err
	}
	return benchParallel(ctx, per, benchFleetWorkers, func(i int) error {
		s, err := concurrency.NewSession(a.cli, concurrency.WithTTL(int(cfg.fleetPoolTTL/time.Second)), concurrency.WithContext(context.Background()))
		if err != nil {
			return err
		}
		a.mu.Lock()
		a.sessions = append(a.sessions, s)
		a.mu.Unlock()
		return concurrency.NewElection(s, key(i)).Campaign(ctx, m.Hostname)
	})
}

// benchFleetStop releases the agents. On a cluster of our own that is
// about to go, the clients are closed first, as in a crash of the whole
// fleet, and nothing is sent to etcd; on another cluster each agent
// resigns and revokes what it holds.
func benchFleetStop(ctx context.Context, agents []*benchFleetAgent, ours bool) {
	if ours {
		for _, a := range agents {
			if a != nil {
				_ = a.cli.Close()
			}
		}
	}
	_ = benchParallel(context.WithoutCancel(ctx), len(agents), len(agents), func(i int) error {
		if a := agents[i]; a != nil {
			a.stop(ours)
		}
		return nil
	})
}

func (a *benchFleetAgent) stop(crashed bool) {
	if a.pool != nil {
		_ = a.pool.Close()
	}
	if a.host != nil {
		_ = a.host.Stop(context.Background())
	}
	a.mu.Lock()
	sessions := a.sessions
	a.mu.Unlock()
	_ = benchParallel(context.Background(), len(sessions), benchFleetWorkers, func(i int) error {
		if crashed {
			sessions[i].Orphan()
		} else {
			_ = sessions[i].Close()
		}
		return nil
	})
	if a.cancel != nil {
		a.cancel()
	}
	if a.lease != clientv3.NoLease && !crashed {
		_, _ = a.cli.Revoke(context.Background(), a.lease)
	}
	_ = a.cli.Close()
}
