package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// benchWideWorkers is how many agents of scenario 12 start at once.
const benchWideWorkers = 32

// benchWideResult is what one fleet size and deployment of scenario 12
// cost.
type benchWideResult struct {
	agents  int
	proxied bool // the watchers' clients go through the gRPC proxy

	hostsUp time.Duration // until every watcher had every host up
	setup   time.Duration // until, besides, every shard had its owner
	owned   bool          // every shard had its owners by then
	leases  int           // etcd's count, once set up
	renewal float64       // LeaseKeepAlive requests per second, over the churn

	startSent int64         // bytes etcd sent while the fleet started
	sent      int64         // bytes etcd sent over the churn
	cpu       time.Duration // etcd's CPU time over the churn
	proxyCPU  time.Duration // the proxy's, over the churn
	churn     time.Duration // from the first update to the last delivery
	watches   int64         // etcd's, at the end

	deliveries int64 // Updated events the watchers delivered over the churn
	lags       benchLatencies
	exact      int // watchers whose hosts matched etcd's at the end

	// After the updates: etcd replaced under the fleet by an empty one
	// (coord), and, in the direct deployment, the same listings at once
	// (plain).
	replaced, atOnce benchWideRelist
}

// benchWideRelist is what a fleet's listings of the hosts cost etcd, and
// how they spread.
type benchWideRelist struct {
	back     time.Duration // until every watcher had listed and had every host, every shard owned
	short    string        // if they had not within the limit: how far they were
	grants   int64         // leases the agents were granted meanwhile: one each if no registration lapsed
	hosts    int64         // hosts registered in etcd at the end
	sent     int64         // bytes etcd sent meanwhile
	cpu      time.Duration // etcd's CPU time meanwhile
	proxyCPU time.Duration // the proxy's, if the watchers go through one
	ownCPU   time.Duration // the agents' process's, if it can be measured
	peak     float64       // etcd's CPU over its busiest sample (about 100 ms), in cores
	listings []time.Time   // when each listing came
}

// spread is the time from the first listing to the last, and the most
// listings within any 100 ms.
func (l benchWideRelist) spread() (time.Duration, int) {
	if len(l.listings) == 0 {
		return 0, 0
	}
	ts := slices.Clone(l.listings)
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	densest := 0
	for i, j := 0, 0; j < len(ts); j++ {
		for ts[j].Sub(ts[i]) >= 100*time.Millisecond {
			i++
		}
		densest = max(densest, j-i+1)
	}
	return ts[len(ts)-1].Sub(ts[0]), densest
}

// own says how busy the agents' process was meanwhile, if measured.
func (l benchWideRelist) own() string {
	if l.ownCPU == 0 {
		return ""
	}
	return fmt.Sprintf("; the agents' process used %.1f s of CPU in %.1f s (%.2f cores)",
		l.ownCPU.Seconds(), l.back.Seconds(), l.ownCPU.Seconds()/l.back.Seconds())
}

// String says it, for a row.
func (l benchWideRelist) String() string {
	spread, densest := l.spread()
	return fmt.Sprintf("%d listings over %.2f s, at most %d in 100 ms; etcd sent %s, CPU %.2f s, %.2f cores over its busiest 100 ms",
		len(l.listings), spread.Seconds(), densest, benchBytes(l.sent), l.cpu.Seconds(), l.peak)
}

// benchWide measures scenario 12: a fleet of agents, each on its own
// client with a HostLiveness, a HostWatcher and, for a quarter of them, a
// ShardSet member riding the registration's lease; the watchers' clients
// straight to etcd, then through one gRPC proxy. Each size and deployment
// runs on an etcd of its own in a child process (and the proxy in another),
// so that their CPU time and sent bytes are theirs alone, whatever
// --endpoints says. The coord column is the fleet watching etcd directly;
// the plain column is the same fleet watching through the proxy.
func benchWide(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	var direct, proxied []benchWideResult
	for _, n := range cfg.wideAgents {
		for _, viaProxy := range []bool{false, true} {
			r, err := benchWideRun(ctx, env, cfg, n, viaProxy)
			if err != nil {
				return nil, fmt.Errorf("%d agents, proxy %v: %w", n, viaProxy, err)
			}
			if viaProxy {
				proxied = append(proxied, r)
			} else {
				direct = append(direct, r)
			}
			env.settle(ctx)
		}
	}
	rows := make([]benchRow, 0, 2*len(direct)+2)
	for i := range direct {
		rows = append(rows, benchWideRow(cfg, direct[i], proxied[i]))
	}
	for _, d := range direct {
		rows = append(rows, benchWideReplacedRow(d))
	}
	for i, p := range proxied {
		rows = append(rows, benchWideReplacedProxyRow(p, direct[i]))
	}
	return append(rows, benchWideSummary(cfg, direct, proxied)...), nil
}

// benchWideRow is the row of one fleet size.
func benchWideRow(cfg Config, d, p benchWideResult) benchRow {
	cell := func(r benchWideResult) string {
		s := fmt.Sprintf("etcd sent %s (start %s), etcd CPU %.2f s, %s etcd watches", benchBytes(r.sent), benchBytes(r.startSent), r.cpu.Seconds(), benchCount(int(r.watches)))
		if r.proxied {
			s += fmt.Sprintf(", proxy CPU %.2f s", r.proxyCPU.Seconds())
		}
		s += fmt.Sprintf("; lag %s; %s of %s deliveries; %d of %d replicas exact; every host up at every watcher after %.1f s, every shard owned after %.1f s",
			r.lags.sorted().p50p99(), benchCount(int(r.deliveries)), benchCount(cfg.wideUpdates*r.agents), r.exact, r.agents, r.hostsUp.Seconds(), r.setup.Seconds())
		if !r.owned {
			s += " (shards not all owned)"
		}
		return s
	}
	return benchRow{
		scenario: fmt.Sprintf("12. Wide fleet: %d agents, each on its own client with a HostLiveness (TTL %s) and a HostWatcher of every host, a quarter also members of a ShardSet of %s shards on the registration's lease; %s host updates at %d/s: etcd's sent bytes and CPU over them, lag from Update to delivery p50 / p99 (coord: watchers straight to etcd; plain column: the same through one gRPC proxy, leases straight to etcd)",
			d.agents, benchSecs(cfg.wideTTL), benchCount(cfg.wideShards), benchCount(cfg.wideUpdates), cfg.wideRate),
		coord: cell(d),
		plain: cell(p),
		ratio: benchRatio(float64(d.sent), float64(p.sent), "etcd's sent bytes"),
		limit: fmt.Sprintf("%s deliveries (every update to every watcher), every replica exact", benchCount(cfg.wideUpdates*d.agents)),
	}
}

// benchWideReplacedRow is the row of one fleet size's etcd replaced.
func benchWideReplacedRow(d benchWideResult) benchRow {
	leases := d.replacedLeases()
	coord, plain := fmt.Sprintf("back after %.2f s; %s; %s", d.replaced.back.Seconds(), d.replaced, leases), d.atOnce.String()
	if d.replaced.short != "" {
		coord = fmt.Sprintf("%s; meanwhile %s; %s", d.replaced.short, d.replaced, leases)
		plain = "not run: the fleet had not settled"
	}
	return benchRow{
		scenario: fmt.Sprintf("12. Wide fleet, same, %d agents, watchers straight to etcd: etcd replaced under the fleet by an empty one (a new cluster, its revisions started over); until every watcher has listed the hosts again and has every host, each registered again, and every shard is owned again (coord), against the same listings all at once (plain: each agent one Get of the hosts and a watch from its revision)",
			d.agents),
		coord: coord,
		plain: plain,
		ratio: benchRatio(d.replaced.peak, d.atOnce.peak, "etcd's busiest 100 ms"),
		limit: "listings again spread, not all at once: each watcher's after etcd answers and a random pause of up to 1 s (plain: all within 100 ms); etcd's busiest 100 ms: coord's is of the whole recovery (registrations, the sets' listings), plain's of the listings alone",
	}
}

// replacedLeases says what became of the registrations after etcd was
// replaced, and how busy the agents' process was meanwhile.
func (r benchWideResult) replacedLeases() string {
	return fmt.Sprintf("%s leases granted to the agents (%s if no registration lapsed), %s hosts registered at the end%s",
		benchCount(int(r.replaced.grants)), benchCount(r.agents), benchCount(int(r.replaced.hosts)), r.replaced.own())
}

// benchWideReplacedProxyRow is the row of one fleet size's etcd replaced
// under the watchers through the proxy, next to the same straight to etcd.
func benchWideReplacedProxyRow(p, d benchWideResult) benchRow {
	recovery := func(r benchWideResult) string {
		leases := r.replacedLeases()
		if r.replaced.short != "" {
			return fmt.Sprintf("%s; meanwhile etcd sent %s, CPU %.2f s; %s", r.replaced.short, benchBytes(r.replaced.sent), r.replaced.cpu.Seconds(), leases)
		}
		return fmt.Sprintf("back after %.2f s; etcd sent %s, CPU %.2f s; %s", r.replaced.back.Seconds(), benchBytes(r.replaced.sent), r.replaced.cpu.Seconds(), leases)
	}
	coord := recovery(p) + fmt.Sprintf("; proxy CPU %.2f s", p.replaced.proxyCPU.Seconds())
	ratio := "n/a (back after)"
	if p.replaced.short == "" && d.replaced.short == "" {
		ratio = benchRatio(p.replaced.back.Seconds(), d.replaced.back.Seconds(), "back after")
	}
	return benchRow{
		scenario: fmt.Sprintf("12. Wide fleet, same, %d agents, watchers through one gRPC proxy (leases straight to etcd): etcd replaced under the fleet by an empty one, as above; until every watcher has listed the hosts again and has every host, each registered again, and every shard is owned again (coord), against the same fleet straight to etcd (plain: the coord column of the row above)",
			p.agents),
		coord: coord,
		plain: recovery(d),
		ratio: ratio,
		limit: "back, every registration healed once (one lease granted per agent); the proxy sends each host's Up to its watchers, etcd to the proxy's watches",
	}
}

// benchWideSummary are the rows over the sizes: how etcd's cost grows with
// the fleet, extrapolated to 10,000 agents, and the leases it holds.
func benchWideSummary(cfg Config, direct, proxied []benchWideResult) []benchRow {
	slope := func(rs []benchWideResult, y func(benchWideResult) float64) (float64, float64) {
		var xs, ys []float64
		for _, r := range rs {
			xs, ys = append(xs, math.Log(float64(r.agents))), append(ys, math.Log(max(y(r), 1)))
		}
		s := benchSlope(xs, ys)
		last := rs[len(rs)-1]
		return s, y(last) * math.Pow(10_000/float64(last.agents), s)
	}
	sent := func(r benchWideResult) float64 { return float64(r.sent) }
	cpu := func(r benchWideResult) float64 { return float64(r.cpu) / float64(time.Millisecond) }
	ds, d10k := slope(direct, sent)
	ps, p10k := slope(proxied, sent)
	dc, dc10k := slope(direct, cpu)
	pc, pc10k := slope(proxied, cpu)
	var leases, renewals []string
	for i, r := range direct {
		leases = append(leases, fmt.Sprintf("%d: %d / %d", r.agents, r.leases, proxied[i].leases))
		renewals = append(renewals, fmt.Sprintf("%d: %.2f / %.2f", r.agents, r.renewal/float64(r.agents), proxied[i].renewal/float64(r.agents)))
	}
	return []benchRow{
		{
			scenario: "12. Wide fleet, same: slope of log(etcd's sent bytes over the updates) against log(agents); sent and CPU extrapolated to 10,000 agents (an extrapolation, not a measurement)",
			coord:    fmt.Sprintf("slope %.2f: %s; CPU slope %.2f: %.1f s", ds, benchBytes(int64(d10k)), dc, dc10k/1000),
			plain:    fmt.Sprintf("slope %.2f: %s; CPU slope %.2f: %.1f s", ps, benchBytes(int64(p10k)), pc, pc10k/1000),
			ratio:    benchRatio(d10k, p10k, "sent at 10,000"),
			limit:    "through the proxy: slope ≈ 0, etcd sending each event once per watch of the proxy's (docs/fleet.md: the proxy's watches grow with a fleet that starts while hosts register); direct: ≈ 1",
		},
		{
			scenario: "12. Wide fleet, same: leases etcd holds (direct / proxy), and LeaseKeepAlive requests per agent per second over the updates",
			coord:    "leases " + strings.Join(leases, "; "),
			plain:    "keep-alives/s per agent " + strings.Join(renewals, "; "),
			ratio:    "",
			limit:    fmt.Sprintf("one lease per agent; %.2f keep-alives/s per agent (one lease every TTL/3)", 3/cfg.wideTTL.Seconds()),
		},
	}
}

// benchWideRun runs a fleet of n agents on an etcd of its own, their
// watchers through a gRPC proxy if viaProxy.
func benchWideRun(ctx context.Context, env *benchEnv, cfg Config, n int, viaProxy bool) (r benchWideResult, err error) {
	r.agents, r.proxied = n, viaProxy
	etcd, err := startBenchCluster(ctx, 1)
	if err != nil {
		return r, err
	}
	defer func() { err = errors.Join(err, etcd.close()) }()
	base := env.base
	base.Endpoints = etcd.endpoints
	watchBase := base
	var proxy *benchCluster
	if viaProxy {
		if proxy, err = startBenchProxy(ctx, etcd.endpoints[0]); err != nil {
			return r, err
		}
		defer func() { err = errors.Join(err, proxy.close()) }()
		watchBase.Endpoints = proxy.endpoints
	}
	books, err := env.clientOf(base)
	if err != nil {
		return r, err
	}
	defer books.Close()

	f := &benchWideFleet{cfg: cfg, prefix: env.prefix("wide", strconv.Itoa(n), strconv.FormatBool(viaProxy))}
	defer func() {
		t := time.Now()
		f.stop()
		env.progress("scenario 12: %d agents (proxy %v) stopped in %v", n, viaProxy, time.Since(t).Round(time.Millisecond))
	}()
	before, err := etcd.stat()
	if err != nil {
		return r, err
	}
	t := time.Now()
	if err := f.start(ctx, env, base, watchBase, n); err != nil {
		return r, err
	}
	if err := f.hostsUp(ctx, n); err != nil {
		return r, err
	}
	r.hostsUp = time.Since(t)
	r.owned = f.owned(ctx) == nil
	r.setup = time.Since(t)
	env.progress("scenario 12: %d agents (proxy %v): every host up at every watcher after %v, shards owned after %v",
		n, viaProxy, r.hostsUp.Round(time.Millisecond), r.setup.Round(time.Millisecond))
	l, err := books.Leases(ctx)
	if err != nil {
		return r, fmt.Errorf("counting leases: %w", err)
	}
	r.leases = len(l.Leases)
	if err := r.measure(ctx, f, etcd, proxy, before, books); err != nil {
		return r, err
	}
	if r.replaced, err = f.replaced(ctx, env, etcd, proxy, books); err != nil {
		return r, fmt.Errorf("etcd replaced: %w", err)
	}
	if r.replaced.short != "" {
		// Listings measured on a fleet that has not settled would say
		// nothing of listings alone.
		env.progress("scenario 12: %d agents (proxy %v): %s", n, viaProxy, r.replaced.short)
		return r, nil
	}
	env.progress("scenario 12: %d agents (proxy %v): every host back at every watcher %v after etcd was replaced",
		n, viaProxy, r.replaced.back.Round(time.Millisecond))
	if viaProxy {
		return r, nil
	}
	if r.atOnce, err = f.listAtOnce(ctx, etcd); err != nil {
		return r, fmt.Errorf("listings at once: %w", err)
	}
	return r, nil
}

// measure runs the updates and reads what they cost.
func (r *benchWideResult) measure(ctx context.Context, f *benchWideFleet, etcd, proxy *benchCluster, before benchClusterStat, books *clientv3.Client) error {
	at, err := etcd.stat()
	if err != nil {
		return err
	}
	r.startSent = at.sent - before.sent
	var proxyAt benchClusterStat
	if proxy != nil {
		if proxyAt, err = proxy.stat(); err != nil {
			return err
		}
	}
	ka := f.cnt.keepAlives.Load()
	t := time.Now()
	if err := f.update(ctx); err != nil {
		return err
	}
	r.churn = time.Since(t)
	r.renewal = float64(f.cnt.keepAlives.Load()-ka) / r.churn.Seconds()
	end, err := etcd.stat()
	if err != nil {
		return err
	}
	r.sent, r.cpu, r.watches = end.sent-at.sent, end.cpu-at.cpu, end.watches
	if proxy != nil {
		pend, err := proxy.stat()
		if err != nil {
			return err
		}
		r.proxyCPU = pend.cpu - proxyAt.cpu
	}
	r.deliveries, r.lags = f.delivered()
	r.exact, err = f.exact(ctx, books)
	return err
}

// benchWideFleet is the fleet of one run of scenario 12.
type benchWideFleet struct {
	cfg    Config
	prefix string
	cnt    benchRPCCounter
	agents []*benchWideAgent
}

// benchWideAgent is one agent: its registration, its watcher, and maybe a
// ShardSet member.
type benchWideAgent struct {
	cli, watchCli *clientv3.Client
	host          *coord.HostLiveness
	w             *coord.HostWatcher
	set           *coord.ShardSet
	followed      chan struct{} // closed once the watcher's events are all read

	up      atomic.Int64   // hosts up in the watcher's events
	updates atomic.Int64   // Updated events delivered
	listed  chan time.Time // when the watcher listed the hosts again
	mu      sync.Mutex
	lags    benchLatencies
}

// start starts n agents.
func (f *benchWideFleet) start(ctx context.Context, env *benchEnv, base, watchBase clientv3.Config, n int) error {
	f.agents = make([]*benchWideAgent, n)
	shards := make([]string, f.cfg.wideShards)
	for i := range shards {
		shards[i] = fmt.Sprintf("s%04d", i)
	}
	return benchParallel(ctx, n, benchWideWorkers, func(i int) error {
		a := &benchWideAgent{followed: make(chan struct{}), listed: make(chan time.Time, 16)}
		var err error
		if a.cli, err = env.clientOf(base, f.cnt.dialOptions()...); err != nil {
			return err
		}
		a.watchCli = a.cli
		f.agents[i] = a
		if watchBase.Endpoints[0] != base.Endpoints[0] {
			if a.watchCli, err = env.clientOf(watchBase); err != nil {
				a.watchCli = a.cli
				return err
			}
		}
		if a.host, err = coord.RegisterHostLiveness(ctx, a.cli, benchMeta("wide", i), coord.LivenessOptions{Prefix: f.prefix + "hosts/", TTL: f.cfg.wideTTL}); err != nil {
			return err
		}
		// UnhealthyAfter as the TTL (the default at the full run's 10 s):
		// a quiet watcher checks etcd's revision every third of it.
		if a.w, err = coord.NewHostWatcher(ctx, a.watchCli, coord.WatcherOptions{Prefix: f.prefix + "hosts/", UnhealthyAfter: f.cfg.wideTTL, OnSignal: a.signal}); err != nil {
			return err
		}
		go a.follow()
		if i%4 != 0 {
			return nil
		}
		// Its host watch through the proxy too, where the watcher's is.
		a.set, err = coord.NewShardSet(ctx, a.cli, coord.ShardOptions{Shards: shards, Host: a.host, Prefix: f.prefix + "shards/",
			WatchClient: a.watchCli, TTL: f.cfg.wideTTL, Run: func(ctx context.Context, _ coord.Shard) { <-ctx.Done() }})
		return err
	})
}

// follow reads the watcher's events: the hosts up, and the lag of each
// update (its "t" label is when it was sent).
func (a *benchWideAgent) follow() {
	defer close(a.followed)
	for ev := range a.w.Events() {
		switch ev.Kind {
		case coord.HostUp:
			a.up.Add(1)
		case coord.HostDown:
			a.up.Add(-1)
		case coord.HostUpdated:
			sent, err := strconv.ParseInt(ev.Metadata.Labels["t"], 10, 64)
			if err != nil {
				continue
			}
			lag := time.Since(time.Unix(0, sent))
			a.mu.Lock()
			a.lags = append(a.lags, lag)
			a.mu.Unlock()
			a.updates.Add(1)
		}
	}
}

// signal notes when the watcher lists the hosts again.
func (a *benchWideAgent) signal(sig coord.Signal) {
	if sig.Kind == coord.SignalWatcherResync {
		select {
		case a.listed <- time.Now():
		default:
		}
	}
}

// replaced replaces etcd under the fleet by an empty one and waits until
// every watcher has listed the hosts again and has every host, each
// registered again on the new etcd, and every shard is owned again. It
// measures from when the new etcd serves, sampling its CPU time about
// every 100 ms, and the CPU time of proxy, if not nil.
func (f *benchWideFleet) replaced(ctx context.Context, env *benchEnv, etcd, proxy *benchCluster, books *clientv3.Client) (r benchWideRelist, err error) {
	for _, a := range f.agents {
		for len(a.listed) > 0 {
			<-a.listed
		}
	}
	// From when the new etcd serves: its start is not the fleet's cost.
	grants := f.cnt.grants.Load()
	before, err := etcd.replace()
	if err != nil {
		return r, err
	}
	t := time.Now()
	own0, ownOK := benchProcessCPU()
	var proxyAt benchClusterStat
	if proxy != nil {
		if proxyAt, err = proxy.stat(); err != nil {
			return r, err
		}
	}
	listed := make([]bool, len(f.agents))
	s := benchCPUSampler{etcd: etcd, last: before}
	told := t
	var relisted, whole int
	err = s.until(ctx, benchWideBackLimit, func() (bool, error) {
		relisted, whole = 0, 0
		for i, a := range f.agents {
			for len(a.listed) > 0 {
				r.listings = append(r.listings, <-a.listed)
				listed[i] = true
			}
			if listed[i] {
				relisted++
				if a.up.Load() == int64(len(f.agents)) {
					whole++
				}
			}
		}
		if time.Since(told) >= 10*time.Second {
			told = time.Now()
			env.progress("scenario 12: %d agents, etcd replaced %v ago: %d watchers listed again, %d of them with every host",
				len(f.agents), time.Since(t).Round(time.Second), relisted, whole)
		}
		if whole < len(f.agents) || !f.ownedAll() {
			return false, nil
		}
		exact, err := f.exact(ctx, books)
		return exact == len(f.agents), err
	})
	r.back = time.Since(t)
	r.sent, r.cpu, r.peak = s.last.sent-before.sent, s.last.cpu-before.cpu, s.peak
	r.grants = f.cnt.grants.Load() - grants
	if own1, ok := benchProcessCPU(); ok && ownOK {
		r.ownCPU = own1 - own0
	}
	if proxy != nil {
		if end, perr := proxy.stat(); perr == nil {
			r.proxyCPU = end.cpu - proxyAt.cpu
		}
	}
	if g, gerr := books.Get(ctx, f.prefix+"hosts/", clientv3.WithPrefix(), clientv3.WithCountOnly()); gerr == nil {
		r.hosts = g.Count
	}
	if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
		r.short = fmt.Sprintf("not back after %v: %d of %d watchers had listed again, %d of them with every host", benchWideBackLimit, relisted, len(f.agents), whole)
		return r, nil
	}
	return r, err
}

// benchWideBackLimit is how long scenario 12 waits for a fleet to be back
// after etcd was replaced.
const benchWideBackLimit = 2 * time.Minute

// listAtOnce has every agent list the hosts and watch them from there, as
// a watcher lists again, all at once (one Get and a watch each, as a
// plain etcd client would), and measures it as replaced does.
func (f *benchWideFleet) listAtOnce(ctx context.Context, etcd *benchCluster) (r benchWideRelist, err error) {
	before, err := etcd.stat()
	if err != nil {
		return r, err
	}
	lctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	start := make(chan struct{})
	listed := make(chan time.Time, len(f.agents))
	errs := make(chan error, len(f.agents))
	for _, a := range f.agents {
		go func() {
			<-start
			errs <- benchListWatch(lctx, a.watchCli, f.prefix+"hosts/", listed)
		}()
	}
	t := time.Now()
	close(start)
	s := benchCPUSampler{etcd: etcd, last: before}
	waited := 0
	err = s.until(lctx, 2*time.Minute, func() (bool, error) {
		for len(errs) > 0 {
			waited++
			if err := <-errs; err != nil {
				return false, err
			}
		}
		return waited == len(f.agents), nil
	})
	cancel()
	for ; waited < len(f.agents); waited++ {
		<-errs
	}
	close(listed)
	for at := range listed {
		r.listings = append(r.listings, at)
	}
	r.back = time.Since(t)
	r.sent, r.cpu, r.peak = s.last.sent-before.sent, s.last.cpu-before.cpu, s.peak
	return r, err
}

// benchListWatch lists prefix, notes when on listed, and watches it from
// the listing's revision until etcd has the watch.
func benchListWatch(ctx context.Context, cli *clientv3.Client, prefix string, listed chan<- time.Time) error {
	g, err := cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return err
	}
	listed <- time.Now()
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for wr := range cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(g.Header.Revision+1), clientv3.WithCreatedNotify()) {
		if wr.Created || wr.Err() != nil {
			return wr.Err()
		}
	}
	return ctx.Err()
}

// benchCPUSampler reads etcd's use about every 100 ms, keeping its busiest
// interval's CPU in cores: CPU time over the child's own clock between
// two readings at least 90 ms apart (an answer can come late).
type benchCPUSampler struct {
	etcd *benchCluster
	last benchClusterStat
	from benchClusterStat // the start of the interval being sampled
	peak float64
}

// until samples until done says so, for at most limit.
func (s *benchCPUSampler) until(ctx context.Context, limit time.Duration, done func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
		case <-ctx.Done():
			return ctx.Err()
		}
		st, err := s.etcd.stat()
		if err != nil {
			return err
		}
		if s.from.at.IsZero() {
			s.from = s.last
		}
		if dt := st.at.Sub(s.from.at); dt >= 90*time.Millisecond {
			s.peak = max(s.peak, float64(st.cpu-s.from.cpu)/float64(dt))
			s.from = st
		}
		s.last = st
		if ok, err := done(); ok || err != nil {
			return err
		}
	}
}

// hostsUp waits until every watcher has the n hosts up.
func (f *benchWideFleet) hostsUp(ctx context.Context, n int) error {
	if err := benchPoll(ctx, time.Minute, func() bool {
		for _, a := range f.agents {
			if a.up.Load() != int64(n) {
				return false
			}
		}
		return true
	}); err != nil {
		return fmt.Errorf("watchers without every host: %w", err)
	}
	return nil
}

// owned waits, a minute at most, until every shard has its owner.
func (f *benchWideFleet) owned(ctx context.Context) error {
	return benchPoll(ctx, time.Minute, f.ownedAll)
}

// ownedAll reports whether every shard has its owner.
func (f *benchWideFleet) ownedAll() bool {
	owned := 0
	for _, a := range f.agents {
		if a.set != nil {
			owned += len(a.set.Owned())
		}
	}
	return owned == f.cfg.wideShards
}

// update updates the agents' metadata in turn, wideRate per second, each
// update's "t" label the time it is sent, then waits until every watcher
// has delivered every update.
func (f *benchWideFleet) update(ctx context.Context) error {
	tick := time.NewTicker(time.Second / time.Duration(f.cfg.wideRate))
	defer tick.Stop()
	for k := range f.cfg.wideUpdates {
		i := k % len(f.agents)
		m := benchMeta("wide", i)
		m.Labels["t"] = strconv.FormatInt(time.Now().UnixNano(), 10)
		if err := f.agents[i].host.Update(ctx, m); err != nil {
			return err
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	want := int64(f.cfg.wideUpdates)
	return benchPoll(ctx, time.Minute, func() bool {
		for _, a := range f.agents {
			if a.updates.Load() < want {
				return false
			}
		}
		return true
	})
}

// delivered returns the updates the watchers delivered and their lags.
func (f *benchWideFleet) delivered() (int64, benchLatencies) {
	var n int64
	var lags benchLatencies
	for _, a := range f.agents {
		a.mu.Lock()
		lags = append(lags, a.lags...)
		a.mu.Unlock()
		n += a.updates.Load()
	}
	return n, lags
}

// exact counts the watchers whose hosts are etcd's: the same hosts, each
// with the same last update.
func (f *benchWideFleet) exact(ctx context.Context, books *clientv3.Client) (int, error) {
	g, err := books.Get(ctx, f.prefix+"hosts/", clientv3.WithPrefix())
	if err != nil {
		return 0, err
	}
	want := map[string]string{} // each host's last update, by HostUUID
	for _, kv := range g.Kvs {
		var m coord.HostMetadata
		if err := json.Unmarshal(kv.Value, &m); err != nil {
			return 0, fmt.Errorf("host %s: %w", kv.Key, err)
		}
		want[m.HostUUID] = m.Labels["t"]
	}
	exact := 0
	for _, a := range f.agents {
		hosts := a.w.Hosts()
		same := len(hosts) == len(want)
		for _, h := range hosts {
			t, ok := want[h.HostUUID]
			same = same && ok && h.Labels["t"] == t
		}
		if same {
			exact++
		}
	}
	return exact, nil
}

// stop closes the agents' clients first, as a crash of the whole fleet
// (the etcd goes with the run), then what ran on them.
func (f *benchWideFleet) stop() {
	// In parallel: a client whose connection etcd is too busy to read
	// takes up to 5 s to close (gRPC's wait for its GOAWAY).
	_ = benchParallel(context.Background(), len(f.agents), len(f.agents), func(i int) error {
		if a := f.agents[i]; a != nil {
			_ = a.cli.Close()
			_ = a.watchCli.Close()
		}
		return nil
	})
	_ = benchParallel(context.Background(), len(f.agents), benchWideWorkers, func(i int) error {
		a := f.agents[i]
		if a == nil {
			return nil
		}
		if a.set != nil {
			_ = a.set.Close()
		}
		if a.w != nil {
			_ = a.w.Close()
			<-a.followed
		}
		if a.host != nil {
			_ = a.host.Stop(context.Background())
		}
		return nil
	})
}

// benchPoll calls done every 20 ms until it returns true, for at most
// limit.
func benchPoll(ctx context.Context, limit time.Duration, done func() bool) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !done() {
		select {
		case <-tick.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}
