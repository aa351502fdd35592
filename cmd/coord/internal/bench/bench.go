// Package bench measures coord side by side with the plain etcd client code
// a user would write, in the same run on the same etcd: failure detection,
// failover, watcher scale and churn, etcd load, campaign throughput, a
// fleet of agents, a ShardSet fleet and a semaphore. Run prints the results as a
// Markdown table.
//
// A binary that imports this package runs, instead of its main, the
// embedded etcd cluster of scenario 9 when the bench starts it as a child
// process (see cluster.go).
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"time"

	"github.com/go-coord/coord/coordtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Config is a bench run: its sizes, what it runs, and on which etcd. Start
// from Full or Quick, the two presets (the zero value runs nothing
// sensible), then set the exported fields.
type Config struct {
	// Only lists the numbers of the scenarios to run, 1 to Scenarios;
	// empty: all of them.
	Only []int
	// Etcd is the client configuration of the cluster to run against,
	// which the run writes under /coord-bench/ and cleans up at the end;
	// nil: an embedded etcd in a temporary directory.
	Etcd *clientv3.Config
	// ShardTTL is scenario 10's TTL of the liveness and of the shard
	// sessions (naive: of each session), whole seconds.
	ShardTTL time.Duration
	// ShardStagger is scenario 10's pause between the starts of two
	// hosts' ShardSets (naive: candidacies) at the cold start; 0: all at
	// once.
	ShardStagger time.Duration
	// Progress receives a line per step of the run; nil: discarded.
	Progress io.Writer
	// JSON, if set, receives the run's Report, as JSON, once the table is
	// printed; Command is the command line the report names.
	JSON    io.Writer
	Command string

	name string // "full" or "quick", for the header

	crashHosts int           // 1: hosts crashed per side
	crashTTL   time.Duration // 1 and 4: TTL of the crashing hosts and leaders
	crashSpan  time.Duration // 1 and 4: crashes are spread at random over this span

	stopHosts int // 2: hosts stopped per side

	resignRounds      int           // 3: resignations per side
	resignSettle      time.Duration // 3: pause between the successor's campaign and the resign
	resignFreshRounds int           // 3b: the same, with a successor that just queued
	resignFreshSettle time.Duration

	leaderCrashes int // 4: elections whose leader crashes, per side

	scaleSizes []int // 5: numbers of registered hosts
	scaleReps  int   // 5: measurements per size and side (median reported)

	churnHosts int           // 6: hosts flapping
	churnRate  int           // 6: writes per second (a flap is a delete then a put)
	churnFor   time.Duration // 6: how long the hosts flap (both watchers follow at once)

	loadKeys        int           // 7: pooled election keys
	loadLivenessTTL time.Duration // 7: TTL of the host's liveness lease
	loadPoolTTL     time.Duration // 7: TTL of the pooled sessions
	loadWindow      time.Duration // 7: how long keep-alives are counted

	campaignFor   time.Duration // 8: measured time per side
	campaignChunk time.Duration // 8: the sides and the floor take turns every chunk

	fleetAgents      int           // 9: agents, each on its own client
	fleetKeys        int           // 9: election keys, shared out evenly among the agents
	fleetMembers     int           // 9: members of the embedded cluster
	fleetLivenessTTL time.Duration // 9: TTL of each agent's liveness lease
	fleetPoolTTL     time.Duration // 9: TTL of the elections' sessions
	fleetWindow      time.Duration // 9: how long renewals and CPU are counted

	shardHosts      int   // 10: hosts of the ShardSet fleet at the start (a join adds one)
	shardCount      int   // 10: shards
	shardNaiveHosts int   // 10b: the size at which the naive plan runs, next to coord; equal to
	shardNaiveCount int   // the above, one coord run serves both
	shardRoll       int   // 10: members restarted in turn, after a drain; 0: neither
	scopeHosts      []int // 10c: the members of each fleet whose roll is measured
	scopeCount      int   // 10c: shards

	semContenders int           // 11: contenders looping Acquire → Release, per side
	semLimit      int           // 11 and 11b: the semaphore's Limit
	semFor        time.Duration // 11: measured time per side
	semChunk      time.Duration // 11: the sides take turns every chunk
	semRounds     int           // 11b: releases per side
	semSettle     time.Duration // 11b: pause between the waiter's queueing and the release

	wideAgents  []int         // 12: the fleet sizes
	wideShards  int           // 12: shards of the set a quarter of the agents are members of
	wideUpdates int           // 12: host updates, the agents in turn
	wideRate    int           // 12: updates per second
	wideTTL     time.Duration // 12: TTL of the registrations (and the set's)
}

// Scenarios is the number of scenarios, the largest number Only takes.
const Scenarios = len(scenarios)

// Full is the full run reported in BENCHMARKS.md (about 20 minutes on 2
// cores). Scenario 10 runs at the library's default TTL and starts its
// hosts all at once, against its goal (BENCHMARKS.md, "Where coord costs
// more"); --shard-stagger spreads the starts.
func Full() Config {
	return Config{
		name:       "full",
		crashHosts: 100, crashTTL: time.Second, crashSpan: time.Second,
		stopHosts:    200,
		resignRounds: 200, resignSettle: 150 * time.Millisecond,
		resignFreshRounds: 50, resignFreshSettle: 20 * time.Millisecond,
		leaderCrashes: 50,
		scaleSizes:    []int{10_000, 100_000}, scaleReps: 5,
		churnHosts: 1000, churnRate: 500, churnFor: 20 * time.Second,
		loadKeys: 10_000, loadLivenessTTL: 10 * time.Second, loadPoolTTL: 30 * time.Second, loadWindow: 30 * time.Second,
		campaignFor: 6 * time.Second, campaignChunk: 500 * time.Millisecond,
		fleetAgents: 50, fleetKeys: 10_000, fleetMembers: 3,
		fleetLivenessTTL: 10 * time.Second, fleetPoolTTL: 30 * time.Second, fleetWindow: 20 * time.Second,
		shardHosts: 32, shardCount: 4096, ShardTTL: 10 * time.Second, ShardStagger: 0,
		shardNaiveHosts: 8, shardNaiveCount: 256, shardRoll: 8,
		scopeHosts: []int{8, 16, 32}, scopeCount: 1024,
		semContenders: 16, semLimit: 4, semFor: 6 * time.Second, semChunk: 500 * time.Millisecond,
		semRounds: 200, semSettle: 100 * time.Millisecond,
		wideAgents: []int{100, 250, 500, 1000}, wideShards: 256, wideUpdates: 1000, wideRate: 100, wideTTL: 10 * time.Second,
	}
}

// Quick is the smoke run of --quick (CI): every row, small sizes, few
// samples, about a minute on 2 cores. It is the full run made small: what it
// leaves as it is (the crash TTL and span, the pauses before a resign, the
// churning hosts, the cluster's members) shapes what a row measures.
func Quick() Config {
	c := Full()
	c.name = "quick"
	c.crashHosts, c.stopHosts, c.leaderCrashes = 20, 20, 10
	c.resignRounds, c.resignFreshRounds = 20, 10
	c.scaleSizes, c.scaleReps = []int{1000, 5000}, 3
	c.churnRate, c.churnFor = 200, 3*time.Second
	c.loadKeys, c.loadLivenessTTL, c.loadPoolTTL, c.loadWindow = 2000, 3*time.Second, 3*time.Second, 3*time.Second
	c.campaignFor, c.campaignChunk = 1500*time.Millisecond, 250*time.Millisecond
	c.fleetAgents, c.fleetKeys = 5, 500
	c.fleetLivenessTTL, c.fleetPoolTTL, c.fleetWindow = 3*time.Second, 3*time.Second, 3*time.Second
	c.shardHosts, c.shardCount, c.ShardTTL, c.ShardStagger = 8, 128, 2*time.Second, 50*time.Millisecond
	c.shardNaiveCount, c.shardRoll = 128, 2
	c.scopeHosts, c.scopeCount = []int{4, 8}, 64
	c.semFor, c.semRounds = time.Second, 15
	c.wideAgents, c.wideShards, c.wideUpdates, c.wideRate, c.wideTTL = []int{8, 16}, 16, 40, 40, 3*time.Second
	return c
}

// scenario is one numbered scenario of the table.
type scenario struct {
	title string // for progress and for the row of a failed scenario
	run   func(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error)
}

var scenarios = [...]scenario{
	{"crash → Down", benchCrashDown},
	{"Stop → Down", benchStopDown},
	{"Resign → successor leads", benchResign},
	{"leader crash → successor leads", benchLeaderCrash},
	{"watcher scale", benchScale},
	{"churn", benchChurn},
	{"etcd load", benchLoad},
	{"campaign throughput", benchCampaign},
	{"fleet", benchFleet},
	{"ShardSet", benchShards},
	{"semaphore", benchSemaphore},
	{"wide fleet", benchWide},
}

// Run runs the scenarios of cfg and prints the table on w. A scenario that
// fails gets a row saying so, and Run then returns an error naming it once
// the table is printed. If ctx ends, Run returns ctx.Err() without the
// table.
func Run(ctx context.Context, cfg Config, w io.Writer) (err error) {
	for _, n := range cfg.Only {
		if n < 1 || n > Scenarios {
			return fmt.Errorf("bench: no scenario %d (1-%d)", n, Scenarios)
		}
	}
	start := time.Now()
	env, err := newBenchEnv(ctx, cfg)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, env.close()) }()
	rep := newReport(cfg.Command, env.desc)

	var rows []benchRow
	var failed []error
	for i, sc := range scenarios {
		n := i + 1
		if len(cfg.Only) > 0 && !slices.Contains(cfg.Only, n) {
			continue
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		r, err := env.runScenario(ctx, cfg, n, sc)
		if err != nil {
			failed = append(failed, err)
		}
		rows = append(rows, r...)
		env.settle(ctx)
	}
	fmt.Fprintf(w, "coord bench (%s run): %s; %d cores (GOMAXPROCS %d), %s %s/%s; took %v.\n\n",
		cfg.name, env.desc, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version(), runtime.GOOS, runtime.GOARCH,
		time.Since(start).Round(time.Second))
	writeBenchTable(w, rows)
	fmt.Fprintf(w, "\nratio = coord ÷ plain etcd, of the figure named in brackets. "+
		"Latencies are p50 / p99 of sorted samples (nearest rank).\n")
	if cfg.JSON != nil {
		rep.Took, rep.Load[1] = time.Since(start).Round(time.Second).String(), loadAverage()
		for _, r := range rows {
			rep.Rows = append(rep.Rows, Row{Scenario: r.scenario, Coord: r.coord, Plain: r.plain, Ratio: r.ratio, Goal: r.limit})
		}
		failed = append(failed, rep.writeJSON(cfg.JSON))
	}
	return errors.Join(failed...)
}

// runScenario runs scenario n and returns its rows; if it fails, a row
// saying so ends them, and the error names the scenario.
func (env *benchEnv) runScenario(ctx context.Context, cfg Config, n int, sc scenario) ([]benchRow, error) {
	env.progress("scenario %d: %s", n, sc.title)
	t := time.Now()
	rows, err := sc.run(ctx, env, cfg)
	env.progress("scenario %d: done in %v", n, time.Since(t).Round(time.Millisecond))
	if err != nil {
		env.progress("scenario %d failed: %v", n, err)
		rows = append(rows, benchRow{scenario: fmt.Sprintf("%d. %s", n, sc.title), coord: "failed: " + err.Error()})
		return rows, fmt.Errorf("scenario %d (%s): %w", n, sc.title, err)
	}
	return rows, nil
}

// benchTempDir is where an embedded etcd keeps its data.
func benchTempDir() (string, error) {
	return os.MkdirTemp("", "coord-bench-")
}

// benchEmbeddedDesc describes the embedded etcd for the header.
func benchEmbeddedDesc() string {
	return fmt.Sprintf("embedded single-member etcd v3.7 (coordtest: TickMs %d, ElectionMs %d, no fsync), in this process",
		coordtest.DefaultTickMs, coordtest.DefaultElectionMs)
}
