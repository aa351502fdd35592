package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-coord/coord"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Scenario 10: a ShardSet fleet. Each host is on its own client, with its
// HostLiveness and its ShardSet; the fleet goes through a cold start, a
// host joining and a host crashing, and what etcd holds once it has
// settled is counted. Next to it, at a size where it fits, the naive plan:
// every host campaigns for every shard, each candidacy on a
// concurrency.Session of its own (a lease per shard per host).

// benchShardResult is what one run of scenario 10 measured.
type benchShardResult struct {
	hosts, shards int
	stagger       time.Duration // between two hosts' starts, at the cold start

	cold          time.Duration // first start → every shard owned as it should be
	coldAfterLast time.Duration // the same, from the last host's start
	lastStart     time.Duration // the last host's start, from the first
	most, fewest  int           // shards owned by one host, once settled from cold
	coldAcq       int           // acquisitions until then
	coldCPU       time.Duration // CPU time of this process (the fleet, etcd, the bench) until then; 0 if not measured
	inLine        time.Duration // naive: start → every host's candidacy for every shard in place

	leases     int   // held once settled from cold
	etcdLeases bool  // leases is etcd's own count (else: the leases of the keys)
	keyLeases  int   // the distinct leases of the run's keys, then
	keys       int64 // under the run's prefix, once settled from cold
	overlaps   int   // times a shard had two live owners at once, by the signals
	joinMoved  int   // acquisitions after the join
	joinRanked int   // coord: shards the new host tops
	join       time.Duration
	crashMoved int // acquisitions after the crash
	crashOwned int // shards the crashed host owned
	crash      time.Duration

	// Leaderships lost (a live host's shard released for it) and heals
	// (a live host registered again), in each phase: none, on a machine
	// that keeps up.
	coldLost, coldHeals, joinLost, joinHeals, crashLost, crashHeals int

	// coord, at the first size only: a drain, then a rolling restart (see
	// shard_roll.go); rolled is whether they were run.
	rolled bool
	drain  benchShardDrainResult
	roll   benchShardRollResult
}

// benchShards measures scenario 10: coord at cfg.shardHosts ×
// cfg.shardCount, then coord and the naive plan at cfg.shardNaiveHosts ×
// cfg.shardNaiveCount (one coord run serves both when the sizes are equal).
func benchShards(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	big, err := benchShardRun(ctx, env, cfg, "coord", cfg.shardHosts, cfg.shardCount, cfg.shardRoll)
	if err != nil {
		return nil, fmt.Errorf("coord, %d × %d: %w", cfg.shardHosts, cfg.shardCount, err)
	}
	env.settle(ctx)
	same := cfg.shardNaiveHosts == cfg.shardHosts && cfg.shardNaiveCount == cfg.shardCount
	small := big
	if !same {
		if small, err = benchShardRun(ctx, env, cfg, "coord", cfg.shardNaiveHosts, cfg.shardNaiveCount, 0); err != nil {
			return nil, fmt.Errorf("coord, %d × %d: %w", cfg.shardNaiveHosts, cfg.shardNaiveCount, err)
		}
		env.settle(ctx)
	}
	naive, err := benchShardRun(ctx, env, cfg, "naive", cfg.shardNaiveHosts, cfg.shardNaiveCount, 0)
	if err != nil {
		return nil, fmt.Errorf("naive, %d × %d: %w", cfg.shardNaiveHosts, cfg.shardNaiveCount, err)
	}
	scopes, err := benchShardScopes(ctx, env, cfg)
	if err != nil {
		return nil, err
	}
	where := "the bench's etcd"
	if env.embedded {
		where = "the bench's embedded single-member etcd"
	}
	head := fmt.Sprintf("10. ShardSet: %d hosts, each on its own client with its HostLiveness, %s shards (Replicas %d, liveness and shard TTL %s), on %s",
		cfg.shardHosts, benchCount(cfg.shardCount), coord.DefaultShardReplicas, benchSecs(cfg.ShardTTL), where)
	if same {
		rows := benchShardRows("10.", head+"; plain: the naive plan (every host campaigns for every shard, a concurrency session per shard per host)", big, &naive)
		return append(rows, benchShardScopeRow(cfg, scopes)), nil
	}
	rows := benchShardRows("10.", head+"; coord only: the naive plan is run in 10b", big, nil)
	rows = append(rows, benchShardRows("10b.",
		fmt.Sprintf("10b. ShardSet at %d hosts × %s shards, next to the naive plan (every host campaigns for every shard, a concurrency session per shard per host); otherwise as 10",
			cfg.shardNaiveHosts, benchCount(cfg.shardNaiveCount)), small, &naive)...)
	return append(rows, benchShardScopeRow(cfg, scopes)), nil
}

// benchShardScopes measures 10c: at each size of cfg.scopeHosts, a fleet
// of coord members started as 10's and a rolling
// restart of a quarter of them; it returns what each roll's watches
// received (see benchShardScope).
func benchShardScopes(ctx context.Context, env *benchEnv, cfg Config) ([]benchShardScope, error) {
	var out []benchShardScope
	for _, n := range cfg.scopeHosts {
		f := newBenchShardFleet(env, cfg, "coord", n, cfg.scopeCount)
		r := benchShardResult{hosts: n, shards: cfg.scopeCount, stagger: cfg.ShardStagger}
		err := f.coldStart(ctx, &r)
		if err == nil {
			err = f.roll(ctx, &r, n/4)
		}
		if err = errors.Join(err, f.close(ctx)); err != nil {
			return nil, fmt.Errorf("coord, scopes at %d × %d: %w", n, cfg.scopeCount, err)
		}
		out = append(out, r.roll.scope)
		env.settle(ctx)
	}
	return out, nil
}

// benchShardScopeRow is 10c's row.
func benchShardScopeRow(cfg Config, scopes []benchShardScope) benchRow {
	var got, all, ratios []string
	met := true
	var xs, ys []float64
	for _, sc := range scopes {
		m := float64(max(sc.members, 1))
		ratio := float64(sc.got) / float64(max(sc.need, 1))
		met = met && ratio <= 1.2
		got = append(got, fmt.Sprintf("M %d: %.0f received, %.0f needed, %.2f× (worst member %.2f×); %s sent",
			sc.members, float64(sc.got)/m, float64(sc.need)/m, ratio, sc.worst, benchBytes(sc.gotBytes)))
		all = append(all, fmt.Sprintf("M %d: %s per member, %.2f× needed; %s sent",
			sc.members, benchCount(sc.all), float64(sc.all)*m/float64(max(sc.need, 1)), benchBytes(sc.allBytes*int64(sc.members))))
		ratios = append(ratios, fmt.Sprintf("%.2f", float64(sc.gotBytes)/float64(max(sc.allBytes*int64(sc.members), 1))))
		xs, ys = append(xs, math.Log(m)), append(ys, math.Log(float64(max(sc.gotBytes, 1))))
	}
	return benchRow{
		scenario: fmt.Sprintf("10c. ShardSet members' watches against fleet size: M members × %s shards (Replicas %d), started as 10's, then a rolling restart of M/4 (as 10's): "+
			"set events a member's watches received during the roll, next to what it needed (the members', and the candidates' of the shards it ranks among the first Replicas+1 for), "+
			"and the bytes of set events etcd sent to all the members; the slope of log(bytes sent) against log(M)",
			benchCount(cfg.scopeCount), coord.DefaultShardReplicas),
		coord: strings.Join(got, "; ") + fmt.Sprintf("; slope %.2f", benchSlope(xs, ys)),
		plain: "a watch of the whole set (what each member received before): " + strings.Join(all, "; "),
		ratio: strings.Join(ratios, " / ") + " (bytes sent)",
		limit: fmt.Sprintf("goal: ≤ 1.2 × needed per member at every M %s; etcd's sent bytes flat in M (slope about 0; a watch of the whole set: about 1)", benchMet(met)),
	}
}

// benchShardRows are the rows of one size: coord's run c, and the naive
// plan's p if it was run at that size.
func benchShardRows(num, head string, c benchShardResult, p *benchShardResult) []benchRow {
	r := benchShardReport{num: num, head: head, c: c, p: p}
	rows := []benchRow{r.coldRow(), r.spreadRow(), r.joinRow(), r.crashRow(), r.leasesRow()}
	if c.rolled {
		rows = append(rows, r.drainRow(), r.rollRow(), r.scopeRow())
	}
	return rows
}

// benchShardReport writes the rows of one size of scenario 10: c is
// coord's run, p the naive plan's, nil if it was not run at that size.
type benchShardReport struct {
	num, head string
	c         benchShardResult
	p         *benchShardResult
}

// plain is the plain cell: f of the naive run, or why there is none.
func (r benchShardReport) plain(f func(p benchShardResult) string) string {
	if r.p == nil {
		return fmt.Sprintf("not run (it would hold %s leases): see 10b", benchCount(r.c.hosts*r.c.shards))
	}
	return f(*r.p)
}

// ratio is the ratio cell of figure f, named what.
func (r benchShardReport) ratio(what string, f func(x benchShardResult) float64) string {
	if r.p == nil {
		return "n/a (" + what + ")"
	}
	return benchRatio(f(r.c), f(*r.p), what)
}

// troubles names what went wrong in a phase, if anything did; phase
// returns a run's leaderships lost and heals in it.
func (r benchShardReport) troubles(phase func(x benchShardResult) (lost, heals int)) string {
	var out []string
	if lost, heals := phase(r.c); lost > 0 || heals > 0 {
		out = append(out, fmt.Sprintf("meanwhile %s released for a lost leadership (ErrLeadershipLost: renewals unanswered in time, mostly) and %s",
			benchPlural(lost, "owned shard"), benchPlural(heals, "registration heal")))
	}
	if r.p != nil {
		if lost, _ := phase(*r.p); lost > 0 {
			out = append(out, fmt.Sprintf("naive: %s lost meanwhile (session ended)", benchPlural(lost, "owned shard")))
		}
	}
	if len(out) == 0 {
		return ""
	}
	return "; " + strings.Join(out, "; ")
}

// overlaps says whether a shard ever had two live owners at once.
func (r benchShardReport) overlaps() string {
	c, p := r.c, r.p
	if c.overlaps == 0 && (p == nil || p.overlaps == 0) {
		return "; no shard had two live owners at once (by the signals)"
	}
	s := fmt.Sprintf("; a shard had two live owners at once, by the signals: %d times", c.overlaps)
	if p != nil {
		s += fmt.Sprintf(" (naive: %d)", p.overlaps)
	}
	return s
}

// perHost is K/(N+1): the shards a host owns once one has joined.
func (r benchShardReport) perHost() float64 { return float64(r.c.shards) / float64(r.c.hosts+1) }

func benchShardSecs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

// benchShardCPU says how much CPU the process used, where it was measured.
func benchShardCPU(d time.Duration) string {
	if d == 0 {
		return ""
	}
	return fmt.Sprintf("; %.1f s of CPU: the fleet, etcd and the bench, until settled", d.Seconds())
}

func (r benchShardReport) coldRow() benchRow {
	c, secs := r.c, benchShardSecs
	naive := ""
	if r.p != nil {
		naive = "; naive: set up once every candidacy is in line, a shard owned once one campaign for it returns (by whichever host started first)"
	}
	return benchRow{
		scenario: r.head + ": cold start, " + benchShardStarts(c.stagger) + " → every shard owned by its top-ranked host (acquire signals, then Owned()); from the first start (and from the last)",
		coord:    fmt.Sprintf("%s (%s; %s acquisitions%s)", secs(c.cold), secs(c.coldAfterLast), benchCount(c.coldAcq), benchShardCPU(c.coldCPU)),
		plain: r.plain(func(p benchShardResult) string {
			return fmt.Sprintf("%s (%s): all %s candidacies in line; every shard owned after %s",
				secs(p.inLine), secs(max(p.inLine-p.lastStart, 0)), benchCount(p.hosts*p.shards), secs(p.cold))
		}),
		ratio: r.ratio("time until set up", func(x benchShardResult) float64 {
			if x.inLine > 0 {
				return x.inLine.Seconds()
			}
			return x.cold.Seconds()
		}),
		limit: fmt.Sprintf("%sacquisitions − %s = handoffs from a lower-ranked host that started first%s%s%s",
			benchShardColdGoal(c), benchCount(c.shards), naive, r.troubles(func(x benchShardResult) (int, int) { return x.coldLost, x.coldHeals }), r.overlaps()),
	}
}

func (r benchShardReport) spreadRow() benchRow {
	c := r.c
	return benchRow{
		scenario: r.num + " same, once settled from cold: shards owned by the busiest host / by the idlest",
		coord:    fmt.Sprintf("%d / %d", c.most, c.fewest),
		plain:    r.plain(func(p benchShardResult) string { return fmt.Sprintf("%d / %d", p.most, p.fewest) }),
		ratio:    r.ratio("busiest", func(x benchShardResult) float64 { return float64(x.most) }),
		limit: fmt.Sprintf("K/N = %.1f; rendezvous hashing spreads them as a fair draw (±%.1f at 1σ); naive: whoever campaigned first owns the shard",
			float64(c.shards)/float64(c.hosts), math.Sqrt(float64(c.shards)*(1-1/float64(c.hosts))/float64(c.hosts))),
	}
}

func (r benchShardReport) joinRow() benchRow {
	c := r.c
	return benchRow{
		scenario: fmt.Sprintf("%s same: host %d joins (registration, then its ShardSet): shards moved, and time from the registration to the last move's acquire", r.num, c.hosts+1),
		coord:    fmt.Sprintf("%d moved (it tops %d) in %s", c.joinMoved, c.joinRanked, benchShardSecs(c.join)),
		plain: r.plain(func(p benchShardResult) string {
			return fmt.Sprintf("%d moved; its %s candidacies in line after %s", p.joinMoved, benchCount(p.shards), benchShardSecs(p.join))
		}),
		ratio: "n/a (moves)",
		limit: fmt.Sprintf("K/(N+1) = %.1f: only the shards the new host tops move, each once; naive: it queues last for every shard, so nothing moves to it%s",
			r.perHost(), r.troubles(func(x benchShardResult) (int, int) { return x.joinLost, x.joinHeals })),
	}
}

func (r benchShardReport) crashRow() benchRow {
	c := r.c
	return benchRow{
		scenario: r.num + " same: the host owning the most shards crashes (its link cut, then its client closed: no resign, no revoke): shards moved, and time until every shard is owned again (coord: by its top-ranked live host)",
		coord:    fmt.Sprintf("%d moved (it owned %d) in %s", c.crashMoved, c.crashOwned, benchShardSecs(c.crash)),
		plain: r.plain(func(p benchShardResult) string {
			return fmt.Sprintf("%d moved (it owned %d) in %s", p.crashMoved, p.crashOwned, benchShardSecs(p.crash))
		}),
		ratio: r.ratio("time", func(x benchShardResult) float64 { return x.crash.Seconds() }),
		limit: fmt.Sprintf("2/3 TTL to TTL + 0.5 s: its leases, renewed every TTL/3, expire at etcd's next expiry check (every 0.5 s), and the standby already in line leads; K/(N+1) = %.1f%s",
			r.perHost(), r.troubles(func(x benchShardResult) (int, int) { return x.crashLost, x.crashHeals })),
	}
}

func (r benchShardReport) leasesRow() benchRow {
	c := r.c
	return benchRow{
		scenario: r.num + " same, once settled from cold: leases held" + benchShardLeasesBy(c) + ", and keys under the run's prefix (count-only Get)",
		coord:    fmt.Sprintf("%s, %s keys", benchShardLeases(c), benchCount(int(c.keys))),
		plain: r.plain(func(p benchShardResult) string {
			return fmt.Sprintf("%s, %s keys", benchShardLeases(p), benchCount(int(p.keys)))
		}),
		ratio: r.ratio("leases", func(x benchShardResult) float64 { return float64(x.leases) }),
		limit: fmt.Sprintf("coord: %s leases, one per host (its registration's, which its member key and up to %s shard elections ride: ShardOptions.Host; the first hosts up take every shard without an owner, those beyond that on sessions of their own, kept while an election is left on them), and %s keys, 2N + Replicas × K (a registration and a member key per host); naive: N × K = %s leases and keys",
			benchCount(c.hosts), benchCount(coord.DefaultKeysPerSession), benchCount(2*c.hosts+coord.DefaultShardReplicas*c.shards), benchCount(c.hosts*c.shards)),
	}
}

// benchShardStarts says how the hosts start at the cold start.
// benchShardColdGoal states the cold start's goal, for hosts started all
// at once: every shard owned within benchShardColdGoal of the start.
func benchShardColdGoal(c benchShardResult) string {
	if c.stagger != 0 {
		return ""
	}
	return fmt.Sprintf("goal, started at once: ≤ %s %s; ", benchShardSecs(benchShardColdLimit), benchMet(c.cold <= benchShardColdLimit))
}

// benchShardColdLimit is the cold start's goal (see benchShardColdGoal).
const benchShardColdLimit = 2 * time.Second

func benchShardStarts(stagger time.Duration) string {
	if stagger == 0 {
		return "every host's ShardSet (naive: its candidacies) started at once"
	}
	return fmt.Sprintf("the hosts' ShardSets (naive: their candidacies) started %g ms apart", float64(stagger)/float64(time.Millisecond))
}

func benchShardLeasesBy(r benchShardResult) string {
	if r.etcdLeases {
		return " (etcd's count, less those held before the run)"
	}
	return " (the leases of the run's keys)"
}

// benchShardLeases formats r's leases, with those of its keys when
// etcd's count differs (a lease of another run coming or going).
func benchShardLeases(r benchShardResult) string {
	if r.etcdLeases && r.keyLeases != r.leases {
		return fmt.Sprintf("%s leases (%s of the run's keys)", benchCount(r.leases), benchCount(r.keyLeases))
	}
	return benchCount(r.leases) + " leases"
}

// benchShardRun runs coord ("coord") or the naive plan ("naive") at n
// hosts × k shards: cold start, a join, a crash; then, for coord when
// roll > 0, a drain and a rolling restart of roll members.
func benchShardRun(ctx context.Context, env *benchEnv, cfg Config, side string, n, k, roll int) (r benchShardResult, err error) {
	f := newBenchShardFleet(env, cfg, side, n, k)
	r.hosts, r.shards, r.stagger = n, k, cfg.ShardStagger
	defer func() { err = errors.Join(err, f.close(ctx)) }()
	baseline, err := f.leaseBaseline(ctx)
	if err != nil {
		return r, err
	}
	f.progress("%d hosts × %s shards: starting", n, benchCount(k))
	if err := f.coldStart(ctx, &r); err != nil {
		return r, err
	}
	if err := f.count(ctx, baseline, &r); err != nil {
		return r, err
	}
	if err := f.join(ctx, &r); err != nil {
		return r, err
	}
	if err := f.crashBusiest(ctx, &r); err != nil || side != "coord" || roll == 0 {
		return r, err
	}
	if err := f.drainBusiest(ctx, &r); err != nil {
		return r, err
	}
	return r, f.roll(ctx, &r, roll)
}

// newBenchShardFleet returns a fleet of side for n hosts × k shards, none
// created yet.
func newBenchShardFleet(env *benchEnv, cfg Config, side string, n, k int) *benchShardFleet {
	f := &benchShardFleet{env: env, side: side, ttl: cfg.ShardTTL, shards: benchShardNames(k),
		prefix: env.prefix("shards", fmt.Sprintf("%s-%dx%d", side, n, k))}
	f.tr = newBenchShardTracker(f.shards)
	return f
}

// leaseBaseline returns how many leases the embedded etcd holds before the
// run, for count to take off; -1 on another etcd, where other clients'
// leases come and go.
func (f *benchShardFleet) leaseBaseline(ctx context.Context) (int, error) {
	if !f.env.embedded {
		return -1, nil
	}
	l, err := f.env.cli.Leases(ctx)
	if err != nil {
		return 0, fmt.Errorf("bench: counting leases: %w", err)
	}
	return len(l.Leases), nil
}

// coldStart creates r.hosts hosts (coord's registered), starts them
// r.stagger apart and waits until every shard is owned as it should be,
// recording in r how long that took and how the shards are spread.
func (f *benchShardFleet) coldStart(ctx context.Context, r *benchShardResult) error {
	n := r.hosts
	if err := benchParallel(ctx, n, n, func(i int) error { return f.newHost(ctx, i) }); err != nil {
		return err
	}
	f.phase(nil)
	cpu0, cpuOK := benchProcessCPU()
	t0 := time.Now()
	starts := make([]time.Time, n)
	if err := benchParallel(ctx, n, n, func(i int) error {
		if err := benchSleep(ctx, time.Duration(i)*r.stagger); err != nil {
			return err
		}
		starts[i] = time.Now()
		return f.start(ctx, f.hosts[i])
	}); err != nil {
		return err
	}
	last := slices.MaxFunc(starts, time.Time.Compare)
	at, err := f.settle(ctx, "every shard owned from cold", 90*time.Second)
	if err != nil {
		return err
	}
	if cpu1, ok := benchProcessCPU(); ok && cpuOK {
		r.coldCPU = cpu1 - cpu0
	}
	r.cold, r.coldAcq = at.Sub(t0), len(f.tr.since(0))
	r.coldAfterLast, r.lastStart = max(at.Sub(last), 0), last.Sub(t0)
	r.most, r.fewest = f.spread()
	r.coldLost, r.coldHeals = f.tr.troubles()
	if f.side == "naive" {
		if r.inLine, err = f.waitKeys(ctx, t0, int64(n*r.shards)); err != nil {
			return err
		}
	}
	f.progress("%d hosts × %s shards: settled from cold in %v (%d acquisitions, %d leaderships lost, %d heals)",
		n, benchCount(r.shards), r.cold.Round(time.Millisecond), r.coldAcq, r.coldLost, r.coldHeals)
	return nil
}

// spread returns how many shards the busiest host owns, and the idlest.
func (f *benchShardFleet) spread() (most, fewest int) {
	fewest = len(f.shards)
	for _, h := range f.hosts {
		o := f.tr.owns(h.id)
		most, fewest = max(most, o), min(fewest, o)
	}
	return most, fewest
}

// join adds host r.hosts: registered, then started, for coord. Until it
// has taken the shards it tops, they are not owned as they should be;
// the naive host has joined once its candidacies are in line.
func (f *benchShardFleet) join(ctx context.Context, r *benchShardResult) (err error) {
	n := r.hosts
	lost0, heals0 := f.tr.troubles()
	if f.side == "coord" {
		r.joinRanked = f.topsOfJoiner(n)
	}
	if err := f.newHost(ctx, n); err != nil {
		return err
	}
	t0 := time.Now()
	mark := f.phase(nil)
	if f.side == "coord" {
		if err := f.register(ctx, f.hosts[n]); err != nil {
			return err
		}
	}
	if err := f.start(ctx, f.hosts[n]); err != nil {
		return err
	}
	if f.side == "coord" {
		// Until the acquire that completes the moves.
		at, err := f.settle(ctx, "every shard owned after the join", time.Minute)
		if err != nil {
			return err
		}
		r.join = at.Sub(t0)
	} else if r.join, err = f.waitKeys(ctx, t0, int64((n+1)*r.shards)); err != nil {
		return err
	}
	r.joinMoved = len(f.tr.since(mark))
	r.joinLost, r.joinHeals = f.tr.troublesSince(lost0, heals0)
	f.progress("host %d joined: %d moved in %v (%d leaderships lost, %d heals)",
		n+1, r.joinMoved, r.join.Round(time.Millisecond), r.joinLost, r.joinHeals)
	return nil
}

// topsOfJoiner returns how many shards host n, about to join, tops: those
// that should move to it.
func (f *benchShardFleet) topsOfJoiner(n int) int {
	ids := f.ids()
	before, after := f.tops(ids), f.tops(append(ids, benchMeta("shard-"+f.side, n).HostUUID))
	moved := 0
	for s, h := range after {
		if before[s] != h {
			moved++
		}
	}
	return moved
}

// crashBusiest crashes the host that owns the most shards (on the naive
// side, who owns what is a race, and some hosts may own nothing) and waits
// until every shard is owned again.
func (f *benchShardFleet) crashBusiest(ctx context.Context, r *benchShardResult) error {
	var victim *benchShardHost
	victim, r.crashOwned = f.busiest()
	lost0, heals0 := f.tr.troubles()
	t0 := time.Now()
	mark := f.phase(victim)
	f.crash(victim)
	at, err := f.settle(ctx, "every shard owned after the crash", time.Minute+3*f.ttl)
	if err != nil {
		return err
	}
	r.crash = at.Sub(t0)
	r.crashMoved = len(f.tr.since(mark))
	r.overlaps = f.tr.overlapCount()
	r.crashLost, r.crashHeals = f.tr.troublesSince(lost0, heals0)
	f.progress("host crashed: %d moved in %v (%d leaderships lost, %d heals)",
		r.crashMoved, r.crash.Round(time.Millisecond), r.crashLost, r.crashHeals)
	return nil
}

// busiest returns the live host that owns the most shards, and how many.
func (f *benchShardFleet) busiest() (*benchShardHost, int) {
	live := f.live()
	busiest, most := live[0], -1
	for _, h := range live {
		if o := f.tr.owns(h.id); o > most {
			busiest, most = h, o
		}
	}
	return busiest, most
}

// live returns the hosts that have not crashed, by index.
func (f *benchShardFleet) live() []*benchShardHost {
	f.mu.Lock()
	defer f.mu.Unlock()
	var live []*benchShardHost
	for _, h := range f.hosts {
		if h != nil && !h.dead {
			live = append(live, h)
		}
	}
	return live
}

// benchShardNames returns k shard names.
func benchShardNames(k int) []string {
	names := make([]string, k)
	for i := range names {
		names[i] = fmt.Sprintf("shard-%05d", i)
	}
	return names
}

// benchShardFleet is the fleet of one run of scenario 10.
type benchShardFleet struct {
	env    *benchEnv
	side   string // "coord" or "naive"
	prefix string // hosts/ and shards/ under it
	ttl    time.Duration
	shards []string
	tr     *benchShardTracker
	// runDrain is how long a Run takes to return after its ctx ends: 0
	// until the drain (see drainBusiest).
	runDrain atomic.Int64

	mu     sync.Mutex
	hosts  []*benchShardHost // by index; a joined host last
	failed error             // a naive candidacy that failed before the end
	wg     sync.WaitGroup    // the naive candidacies
}

// benchShardHost is one host of a fleet, on its own client.
type benchShardHost struct {
	id   string
	meta coord.HostMetadata
	cli  *clientv3.Client
	link *benchLink
	dead bool // crashed

	draining bool // its ShardSet drains: ranked out, owning nothing once drained

	// coord
	live *coord.HostLiveness
	set  *coord.ShardSet
	// naive
	ctx      context.Context
	cancel   context.CancelFunc
	mu       sync.Mutex
	sessions []*concurrency.Session
}

func (f *benchShardFleet) progress(format string, args ...any) {
	f.env.progress("scenario 10 (%s): %s", f.side, fmt.Sprintf(format, args...))
}

// newHost creates host i and its client; coord's host is registered too,
// unless it is the one that joins later (i == len(hosts) after the start).
func (f *benchShardFleet) newHost(ctx context.Context, i int) error {
	link := &benchLink{set: f.prefix + "shards/"}
	cli, err := f.env.client(link.dialOptions()...)
	if err != nil {
		return err
	}
	m := benchMeta("shard-"+f.side, i)
	h := &benchShardHost{id: m.HostUUID, meta: m, cli: cli, link: link}
	h.ctx, h.cancel = context.WithCancel(context.Background())
	f.mu.Lock()
	for len(f.hosts) <= i {
		f.hosts = append(f.hosts, nil)
	}
	f.hosts[i] = h
	joining := f.tr.started()
	f.mu.Unlock()
	if f.side == "coord" && !joining {
		return f.register(ctx, h)
	}
	return nil
}

// register registers coord host h.
func (f *benchShardFleet) register(ctx context.Context, h *benchShardHost) error {
	live, err := coord.RegisterHostLiveness(ctx, h.cli, h.meta, coord.LivenessOptions{Prefix: f.prefix + "hosts/", TTL: f.ttl,
		OnSignal: func(sig coord.Signal) {
			if sig.Kind == coord.SignalRegistered && sig.Attempt > 0 {
				f.tr.note(sig.Host, &f.tr.heals)
			}
		}})
	f.mu.Lock()
	h.live = live // nil after an error
	f.mu.Unlock()
	return err
}

// start starts h's part: its ShardSet, or its naive candidacies (one
// goroutine each, all at once, as a ShardSet starts its workers).
func (f *benchShardFleet) start(ctx context.Context, h *benchShardHost) error {
	if f.side == "coord" {
		set, err := coord.NewShardSet(ctx, h.cli, f.shardOptions(h))
		f.mu.Lock()
		h.set = set // nil after an error
		f.mu.Unlock()
		return err
	}
	for _, shard := range f.shards {
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			if err := f.candidacy(h, shard); err != nil && h.ctx.Err() == nil {
				f.mu.Lock()
				if f.failed == nil {
					f.failed = fmt.Errorf("bench: naive candidacy of %s for %s: %w", h.id, shard, err)
				}
				f.mu.Unlock()
				f.tr.kick()
			}
		}()
	}
	return nil
}

// shardOptions are host h's ShardSet's: its signals feed the tracker.
func (f *benchShardFleet) shardOptions(h *benchShardHost) coord.ShardOptions {
	return coord.ShardOptions{
		Shards: f.shards, Host: h.live, Prefix: f.prefix + "shards/", TTL: f.ttl,
		MaxMoves: benchShardMaxMoves,
		Run: func(ctx context.Context, _ coord.Shard) {
			<-ctx.Done()
			// The work's own drain: what a handoff waits for.
			time.Sleep(time.Duration(f.runDrain.Load()))
		},
		OnSignal: func(sig coord.Signal) {
			switch sig.Kind {
			case coord.SignalLeadershipGained: // the pool's: Key is the shard's election
				f.tr.lead(strings.TrimPrefix(sig.Key, f.prefix+"shards/"), sig.Identity)
			case coord.SignalShardAcquired:
				f.tr.set(sig.Shard, sig.Host, true, 0)
			case coord.SignalShardReleased:
				if errors.Is(sig.Err, coord.ErrLeadershipLost) {
					f.tr.note(sig.Host, &f.tr.lost)
				}
				f.tr.set(sig.Shard, sig.Host, false, sig.Drain)
			}
		},
	}
}

// candidacy is the naive plan for one shard of one host: a session of its
// own, an election, a campaign; owned from the campaign's return until
// the session ends.
func (f *benchShardFleet) candidacy(h *benchShardHost, shard string) error {
	s, err := concurrency.NewSession(h.cli, concurrency.WithTTL(int(f.ttl/time.Second)), concurrency.WithContext(h.ctx))
	if err != nil {
		return err
	}
	h.mu.Lock()
	h.sessions = append(h.sessions, s)
	h.mu.Unlock()
	if err := concurrency.NewElection(s, f.prefix+"shards/"+shard).Campaign(h.ctx, h.id); err != nil {
		return err
	}
	f.tr.set(shard, h.id, true, 0)
	<-s.Done()
	if h.ctx.Err() == nil {
		f.tr.note(h.id, &f.tr.lost)
	}
	f.tr.set(shard, h.id, false, 0)
	return nil
}

// crash cuts h's link, then closes its client: nothing of h reaches etcd
// any more, where its leases expire.
func (f *benchShardFleet) crash(h *benchShardHost) {
	f.mu.Lock()
	h.dead = true
	f.mu.Unlock()
	h.link.cut.Store(true)
	h.cancel()
	_ = h.cli.Close()
}

// ids returns the ids of the hosts that have not crashed.
func (f *benchShardFleet) ids() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ids []string
	for _, h := range f.hosts {
		if h != nil && !h.dead {
			ids = append(ids, h.id)
		}
	}
	return ids
}

// tops returns the top-ranked of hosts for each shard.
func (f *benchShardFleet) tops(hosts []string) map[string]string {
	top := make(map[string]string, len(f.shards))
	for _, s := range f.shards {
		top[s] = coord.RankHosts(s, hosts)[0]
	}
	return top
}

// phase starts a phase of the run: from now on the shards should be owned
// by the live hosts (all but the crashed ones, and victim), coord's by
// their top-ranked one but a draining host, which should own none. It
// returns the mark of the phase's acquisitions.
func (f *benchShardFleet) phase(victim *benchShardHost) int {
	f.mu.Lock()
	live := map[string]bool{}
	var ids []string
	for _, h := range f.hosts {
		if h != nil && !h.dead && h != victim {
			live[h.id] = true
			if !h.draining {
				ids = append(ids, h.id)
			}
		}
	}
	f.mu.Unlock()
	var top map[string]string
	if f.side == "coord" {
		top = f.tops(ids)
	}
	return f.tr.phase(top, live)
}

// settle waits until the tracker sees every shard owned as it should be,
// and for coord until every live host's Owned() agrees; it returns when
// the last ownership that made it so was acquired.
func (f *benchShardFleet) settle(ctx context.Context, what string, timeout time.Duration) (time.Time, error) {
	at, err := f.tr.wait(ctx, timeout, what, f.err, f.progress)
	if err != nil || f.side != "coord" {
		return at, err
	}
	// Owned() judges each leadership at the call: it must agree with the
	// signals.
	deadline := time.Now().Add(10 * time.Second)
	for {
		bad := f.ownedMismatch()
		if bad == "" {
			return at, nil
		}
		if time.Now().After(deadline) {
			return at, fmt.Errorf("bench: %s by the signals, but not by Owned(): %s", what, bad)
		}
		if err := benchSleep(ctx, 50*time.Millisecond); err != nil {
			return at, err
		}
	}
}

// ownedMismatch returns "" when each shard is in the Owned() of its
// top-ranked live host (not a draining one) and of no other live host,
// else what differs.
func (f *benchShardFleet) ownedMismatch() string {
	f.mu.Lock()
	var ids []string
	sets := map[string]*coord.ShardSet{}
	for _, h := range f.hosts {
		if h != nil && !h.dead && h.set != nil {
			sets[h.id] = h.set
			if !h.draining {
				ids = append(ids, h.id)
			}
		}
	}
	f.mu.Unlock()
	owners := map[string][]string{}
	for id, set := range sets {
		for _, s := range set.Owned() {
			owners[s.Name] = append(owners[s.Name], id)
		}
	}
	top := f.tops(ids)
	bad := 0
	for _, s := range f.shards {
		if o := owners[s]; len(o) != 1 || o[0] != top[s] {
			bad++
		}
	}
	if bad == 0 {
		return ""
	}
	return fmt.Sprintf("%d of %d shards not owned by their top-ranked host alone", bad, len(f.shards))
}

func (f *benchShardFleet) err() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failed
}

// waitKeys waits until n keys are under the shards' prefix (every
// candidacy in line), and returns how long after t0 that was seen.
func (f *benchShardFleet) waitKeys(ctx context.Context, t0 time.Time, n int64) (time.Duration, error) {
	deadline := time.Now().Add(90 * time.Second)
	for {
		g, err := f.env.cli.Get(ctx, f.prefix+"shards/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			return 0, fmt.Errorf("bench: counting candidacies: %w", err)
		}
		if g.Count >= n {
			return time.Since(t0), nil
		}
		if err := f.err(); err != nil {
			return 0, err
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("bench: %d candidacies in line, want %d", g.Count, n)
		}
		if err := benchSleep(ctx, 20*time.Millisecond); err != nil {
			return 0, err
		}
	}
}

// count records in r the leases held (etcd's count less baseline, or
// when baseline < 0 the distinct leases of the run's keys), the leases of
// the run's keys, and the keys under the run's prefix.
func (f *benchShardFleet) count(ctx context.Context, baseline int, r *benchShardResult) error {
	g, err := f.env.cli.Get(ctx, f.prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return fmt.Errorf("bench: counting keys: %w", err)
	}
	ls, err := f.keyLeases(ctx)
	if err != nil {
		return err
	}
	r.keys, r.leases, r.keyLeases = g.Count, len(ls), len(ls)
	if baseline >= 0 {
		l, err := f.env.cli.Leases(ctx)
		if err != nil {
			return fmt.Errorf("bench: counting leases: %w", err)
		}
		r.leases, r.etcdLeases = len(l.Leases)-baseline, true
	}
	return nil
}

// keyLeases returns the distinct leases of the keys under the run's
// prefix.
func (f *benchShardFleet) keyLeases(ctx context.Context) ([]clientv3.LeaseID, error) {
	// Not WithKeysOnly: it leaves the leases out.
	g, err := f.env.cli.Get(ctx, f.prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("bench: listing the run's keys: %w", err)
	}
	seen := map[clientv3.LeaseID]bool{}
	var out []clientv3.LeaseID
	for _, kv := range g.Kvs {
		if id := clientv3.LeaseID(kv.Lease); id != 0 && !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out, nil
}

// close crashes the whole fleet (nothing more is sent by its hosts), ends
// its goroutines, then revokes the leases of the run's keys and deletes
// what is left of them.
func (f *benchShardFleet) close(ctx context.Context) error {
	f.mu.Lock()
	hosts := f.hosts
	f.mu.Unlock()
	ctx = context.WithoutCancel(ctx)
	for _, h := range hosts {
		if h != nil {
			f.crash(h)
		}
	}
	_ = benchParallel(ctx, len(hosts), len(hosts), func(i int) error {
		h := hosts[i]
		if h == nil {
			return nil
		}
		if h.set != nil {
			_ = h.set.Close()
		}
		if h.live != nil {
			sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_ = h.live.Stop(sctx)
			cancel()
		}
		return nil
	})
	f.wg.Wait()
	for _, h := range hosts {
		if h == nil {
			continue
		}
		h.mu.Lock()
		for _, s := range h.sessions {
			s.Orphan()
		}
		h.mu.Unlock()
	}
	ls, err := f.keyLeases(ctx)
	if err != nil {
		return err
	}
	if err := benchParallel(ctx, len(ls), 8, func(i int) error {
		_, err := f.env.cli.Revoke(ctx, ls[i])
		if err != nil && !strings.Contains(err.Error(), "lease not found") {
			return fmt.Errorf("bench: revoking the run's leases: %w", err)
		}
		return nil
	}); err != nil {
		return err
	}
	if _, err := f.env.cli.Delete(ctx, f.prefix, clientv3.WithPrefix()); err != nil {
		return fmt.Errorf("bench: deleting the run's keys: %w", err)
	}
	return nil
}

// benchShardTracker follows who owns each shard, from the signals (coord)
// or the campaigns' returns and the sessions' ends (naive), and tells when
// every shard is owned as it should be: by exactly one live host, and for
// coord by its top-ranked live host.
type benchShardTracker struct {
	mu       sync.Mutex
	top      map[string]string // nil: any one live owner will do
	live     map[string]bool
	holders  map[string]map[string]bool // by shard: the hosts that own it
	ok       map[string]bool            // by shard: owned as it should be
	good     int                        // shards owned as they should be
	acquired []benchShardAcquire
	released []benchShardRelease
	settled  time.Time // when good last reached every shard; zero while not
	overlaps int
	lost     int // a live host's shard released because its leadership was lost
	heals    int // a live host registered again
	phases   int
	changed  chan struct{}
	led      map[[2]string]time.Time // by shard and host: its last leadership gained
}

// note counts one more of *n, if host is live.
func (t *benchShardTracker) note(host string, n *int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.live[host] {
		*n++
	}
}

// troubles returns the counts of lost leaderships and of heals so far.
func (t *benchShardTracker) troubles() (lost, heals int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.lost, t.heals
}

// troublesSince returns the counts of lost leaderships and of heals since
// troubles returned lost0 and heals0.
func (t *benchShardTracker) troublesSince(lost0, heals0 int) (lost, heals int) {
	lost, heals = t.troubles()
	return lost - lost0, heals - heals0
}

// benchShardAcquire is an acquire signal: at is when it came, led when
// the acquirer's leadership of the shard began before it (the pool's
// leadership signal: its campaign won; zero if none came).
type benchShardAcquire struct {
	host, shard string
	at, led     time.Time
}

// benchShardRelease is a release signal: at is when it came, ended when
// the shard's Run's ctx ended (at less the signal's Drain).
type benchShardRelease struct {
	host, shard string
	at, ended   time.Time
}

// benchShardMark marks the acquisitions and releases recorded so far.
type benchShardMark struct{ acquired, released int }

func (t *benchShardTracker) mark() benchShardMark {
	t.mu.Lock()
	defer t.mu.Unlock()
	return benchShardMark{len(t.acquired), len(t.released)}
}

// handoffs returns what the acquisitions and releases from m on say of
// the handoffs.
func (t *benchShardTracker) handoffs(m benchShardMark) benchShardHandoffs {
	t.mu.Lock()
	acq := slices.Clone(t.acquired[m.acquired:])
	rel := slices.Clone(t.released[m.released:])
	t.mu.Unlock()
	return benchShardHandoffsOf(acq, rel)
}

func newBenchShardTracker(shards []string) *benchShardTracker {
	t := &benchShardTracker{holders: map[string]map[string]bool{}, ok: map[string]bool{}, live: map[string]bool{},
		changed: make(chan struct{}, 1), led: map[[2]string]time.Time{}}
	for _, s := range shards {
		t.holders[s] = map[string]bool{}
		t.ok[s] = false
	}
	return t
}

// started reports whether the first phase has begun.
func (t *benchShardTracker) started() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.phases > 0
}

func (t *benchShardTracker) kick() {
	select {
	case t.changed <- struct{}{}:
	default:
	}
}

// owners returns the live owners of shard.
func (t *benchShardTracker) ownersLocked(shard string) (n int, who string) {
	for h := range t.holders[shard] {
		if t.live[h] {
			n++
			who = h
		}
	}
	return n, who
}

func (t *benchShardTracker) okLocked(shard string) bool {
	n, who := t.ownersLocked(shard)
	return n == 1 && (t.top == nil || t.top[shard] == who)
}

// set records that host acquired (held) or released shard; drain is how
// long the released shard's Run took to return after its ctx ended.
func (t *benchShardTracker) set(shard, host string, held bool, drain time.Duration) {
	now := time.Now()
	t.mu.Lock()
	hs, known := t.holders[shard]
	if !known {
		t.mu.Unlock()
		return
	}
	if held {
		hs[host] = true
		t.acquired = append(t.acquired, benchShardAcquire{host, shard, now, t.led[[2]string{shard, host}]})
		if n, _ := t.ownersLocked(shard); n > 1 {
			t.overlaps++
		}
	} else {
		delete(hs, host)
		t.released = append(t.released, benchShardRelease{host, shard, now, now.Add(-drain)})
	}
	t.updateLocked(shard, now)
	t.mu.Unlock()
	t.kick()
}

// lead records that host's leadership of shard began (its campaign won).
func (t *benchShardTracker) lead(shard, host string) {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, known := t.holders[shard]; known {
		t.led[[2]string{shard, host}] = now
	}
}

func (t *benchShardTracker) updateLocked(shard string, now time.Time) {
	was, is := t.ok[shard], t.okLocked(shard)
	t.ok[shard] = is
	switch {
	case is && !was:
		t.good++
		if t.good == len(t.ok) {
			t.settled = now
		}
	case was && !is:
		t.good--
		t.settled = time.Time{}
	}
}

// phase sets what the shards' owners should be from now on, and returns
// the mark of the acquisitions to come.
func (t *benchShardTracker) phase(top map[string]string, live map[string]bool) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.phases++
	t.top, t.live = top, live
	now := time.Now()
	t.good = 0
	for s := range t.ok {
		t.ok[s] = t.okLocked(s)
		if t.ok[s] {
			t.good++
		}
	}
	t.settled = time.Time{}
	if t.good == len(t.ok) {
		t.settled = now
	}
	return len(t.acquired)
}

// since returns the acquisitions from mark on.
func (t *benchShardTracker) since(mark int) []benchShardAcquire {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]benchShardAcquire(nil), t.acquired[mark:]...)
}

// owns returns how many shards host owns now.
func (t *benchShardTracker) owns(host string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, hs := range t.holders {
		if hs[host] {
			n++
		}
	}
	return n
}

func (t *benchShardTracker) overlapCount() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.overlaps
}

// wait waits until every shard is owned as it should be, and returns when
// that became so. failed reports a failure of the fleet; progress is
// called every 10 s meanwhile.
func (t *benchShardTracker) wait(ctx context.Context, timeout time.Duration, what string, failed func() error, progress func(string, ...any)) (time.Time, error) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Second)
	defer tick.Stop()
	start := time.Now()
	for {
		t.mu.Lock()
		settled, good, all, lost, heals := t.settled, t.good, len(t.ok), t.lost, t.heals
		t.mu.Unlock()
		if !settled.IsZero() {
			return settled, nil
		}
		if err := failed(); err != nil {
			return time.Time{}, err
		}
		select {
		case <-t.changed:
		case <-tick.C:
			progress("waiting for %s: %d of %d shards owned as they should be after %v (so far %d leaderships lost, %d heals)",
				what, good, all, time.Since(start).Round(time.Second), lost, heals)
		case <-deadline.C:
			return time.Time{}, fmt.Errorf("bench: not %s after %v: %d of %d shards owned as they should be (%d leaderships lost, %d heals so far)",
				what, timeout, good, all, lost, heals)
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		}
	}
}

// benchLink is a host's link to etcd, which a crash cuts: from then on no
// request, stream or message of the client reaches etcd, and nothing
// from etcd reaches it, as a network partition or a dead process.
type benchLink struct {
	cut atomic.Bool
	// set is the shard set's prefix; events and bytes count the events
	// under it that the host's watches received, and their size.
	set           string
	events, bytes atomic.Int64
}

func (l *benchLink) dialOptions() []grpc.DialOption {
	errCut := status.Error(codes.Unavailable, "bench: link cut")
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			if l.cut.Load() {
				return errCut
			}
			return invoker(ctx, method, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			if l.cut.Load() {
				return nil, errCut
			}
			s, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil {
				return nil, err
			}
			return benchLinkStream{ClientStream: s, l: l}, nil
		}),
	}
}

// benchLinkStream drops what is sent and received once its link is cut.
type benchLinkStream struct {
	grpc.ClientStream
	l *benchLink
}

func (s benchLinkStream) SendMsg(m any) error {
	if s.l.cut.Load() {
		return nil
	}
	return s.ClientStream.SendMsg(m)
}

func (s benchLinkStream) RecvMsg(m any) error {
	for {
		err := s.ClientStream.RecvMsg(m)
		if err != nil || !s.l.cut.Load() {
			s.l.count(m)
			return err
		}
	}
}

// count counts the events under the set's prefix of m, if it is a
// watch's response.
func (l *benchLink) count(m any) {
	wr, ok := m.(*etcdserverpb.WatchResponse)
	if !ok || l.set == "" {
		return
	}
	for _, ev := range wr.Events {
		if strings.HasPrefix(string(ev.Kv.Key), l.set) {
			l.events.Add(1)
			l.bytes.Add(int64(proto.Size(ev)))
		}
	}
}
