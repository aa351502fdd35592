package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-coord/coord/coordtest"
)

// benchConfig sizes a bench run. benchFull and benchQuick are the two
// presets; the tests use smaller ones.
type benchConfig struct {
	name string     // "full" or "quick", for the header
	conn *connFlags // the cluster of --endpoints; nil: an embedded etcd
	only []int      // scenario numbers to run; empty: all

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

	shardHosts      int           // 10: hosts of the ShardSet fleet at the start (a join adds one)
	shardCount      int           // 10: shards
	shardTTL        time.Duration // 10: TTL of the liveness and of the shard sessions (naive: of each session)
	shardStagger    time.Duration // 10: pause between the starts of two hosts' ShardSets (naive: candidacies) at the cold start
	shardNaiveHosts int           // 10b: the size at which the naive plan runs, next to coord; equal to
	shardNaiveCount int           // the above, one coord run serves both
}

// benchFull is the full run reported in BENCHMARKS.md (under 10 minutes
// on 2 cores). Scenario 10 runs at the library's default TTL and starts
// its hosts 100 ms apart: started all at once, 32 hosts × 4,096 shards,
// all in this process next to etcd on 2 cores, lose leaderships to
// renewals answered too late, and at times do not settle for minutes (see
// BENCHMARKS.md; --shard-stagger 0 shows it).
var benchFull = benchConfig{
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
	shardHosts: 32, shardCount: 4096, shardTTL: 10 * time.Second, shardStagger: 100 * time.Millisecond,
	shardNaiveHosts: 8, shardNaiveCount: 256,
}

// benchQuick is the smoke run of --quick (CI): every row, small sizes, few
// samples, under 60 s on 2 cores.
var benchQuick = benchConfig{
	name:       "quick",
	crashHosts: 20, crashTTL: time.Second, crashSpan: time.Second,
	stopHosts:    20,
	resignRounds: 20, resignSettle: 150 * time.Millisecond,
	resignFreshRounds: 10, resignFreshSettle: 20 * time.Millisecond,
	leaderCrashes: 10,
	scaleSizes:    []int{1000, 5000}, scaleReps: 3,
	churnHosts: 1000, churnRate: 200, churnFor: 3 * time.Second,
	loadKeys: 2000, loadLivenessTTL: 3 * time.Second, loadPoolTTL: 3 * time.Second, loadWindow: 3 * time.Second,
	campaignFor: 1500 * time.Millisecond, campaignChunk: 250 * time.Millisecond,
	fleetAgents: 5, fleetKeys: 500, fleetMembers: 3,
	fleetLivenessTTL: 3 * time.Second, fleetPoolTTL: 3 * time.Second, fleetWindow: 3 * time.Second,
	shardHosts: 8, shardCount: 128, shardTTL: 2 * time.Second, shardStagger: 50 * time.Millisecond,
	shardNaiveHosts: 8, shardNaiveCount: 128,
}

// cmdBench runs `coord bench`: failure detection, failover, watcher scale
// and etcd load, coord side by side with the plain etcd client code a user
// would write, in the same run on the same etcd. It prints a Markdown table
// on stdout and its progress on stderr. A scenario that fails gets a row
// saying so, and cmdBench then returns an error once the table is printed.
func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := benchParseFlags(args, stdout)
	if err != nil {
		return err
	}
	return benchRun(ctx, cfg, stdout, stderr)
}

func benchParseFlags(args []string, stdout io.Writer) (benchConfig, error) {
	c := newCmdFlags("bench", "", `Measure coord side by side with the plain etcd client code a user would
write, in the same run on the same etcd, and print a Markdown table:
failure detection (crash and Stop → Down), failover (resign and leader
crash), watcher scale and churn, etcd load (lease renewals), campaign
throughput, a fleet of agents leading many keys, and a ShardSet fleet
(scenario 10: shards spread over 32 hosts from a cold start, through a
join and a crash, next to every host campaigning for every shard on a
lease per shard, at a size where that fits). Progress goes to stderr.

By default it starts an embedded single-member etcd in a temporary
directory, and for the fleet (scenario 9) a 3-member one per side in a
child process. With --endpoints it runs against that cluster instead,
writing under /coord-bench/ and deleting what it wrote at the end; it
creates about 250 clients and, in the full run, 100,000 keys. The full
run takes about six minutes, --quick under one.`, true)
	quick := c.Bool("quick", false, "a short smoke run: small sizes and few samples, every row")
	only := c.String("only", "", "comma-separated `numbers` of the scenarios to run, 1-10 (default all)")
	shardTTL := c.Duration("shard-ttl", benchFull.shardTTL, "TTL of scenario 10's registrations and shard sessions, whole seconds (--quick: "+benchQuick.shardTTL.String()+")")
	shardStagger := c.Duration("shard-stagger", benchFull.shardStagger, "pause between two hosts' starts in scenario 10's cold start; 0: all at once")
	if _, err := c.parse(args, stdout, 0); err != nil {
		return benchConfig{}, err
	}
	cfg := benchFull
	if *quick {
		cfg = benchQuick
	}
	var err error
	c.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "endpoints":
			cfg.conn = c.conn
		case "shard-ttl":
			if *shardTTL < time.Second || *shardTTL%time.Second != 0 {
				err = usagef("--shard-ttl %v: want whole seconds, at least 1s", *shardTTL)
			}
			cfg.shardTTL = *shardTTL
		case "shard-stagger":
			if *shardStagger < 0 || *shardStagger > 10*time.Second {
				err = usagef("--shard-stagger %v: want 0 to 10s", *shardStagger)
			}
			cfg.shardStagger = *shardStagger
		}
	})
	if err != nil {
		return benchConfig{}, err
	}
	if cfg.conn != nil {
		if err := cfg.conn.check(); err != nil {
			return benchConfig{}, err
		}
	}
	for _, s := range strings.Split(*only, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > len(benchScenarios) {
			return benchConfig{}, usagef("--only: %q is not a scenario number (1-%d)", s, len(benchScenarios))
		}
		cfg.only = append(cfg.only, n)
	}
	return cfg, nil
}

// benchScenario is one numbered scenario of the table.
type benchScenario struct {
	title string // for progress and for the row of a failed scenario
	run   func(ctx context.Context, env *benchEnv, cfg benchConfig) ([]benchRow, error)
}

var benchScenarios = []benchScenario{
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
}

// benchRun runs the scenarios of cfg and prints the table.
func benchRun(ctx context.Context, cfg benchConfig, stdout, stderr io.Writer) (err error) {
	start := time.Now()
	env, err := newBenchEnv(ctx, cfg, stderr)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, env.close()) }()

	var rows []benchRow
	var failed []error
	for i, sc := range benchScenarios {
		n := i + 1
		if len(cfg.only) > 0 && !slices.Contains(cfg.only, n) {
			continue
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		env.progress("scenario %d: %s", n, sc.title)
		t := time.Now()
		r, err := sc.run(ctx, env, cfg)
		env.progress("scenario %d: done in %v", n, time.Since(t).Round(time.Millisecond))
		if err != nil {
			env.progress("scenario %d failed: %v", n, err)
			failed = append(failed, fmt.Errorf("scenario %d (%s): %w", n, sc.title, err))
			r = append(r, benchRow{scenario: fmt.Sprintf("%d. %s", n, sc.title), coord: "failed: " + err.Error()})
		}
		rows = append(rows, r...)
		env.settle(ctx)
	}
	fmt.Fprintf(stdout, "coord bench (%s run): %s; %d cores (GOMAXPROCS %d), %s %s/%s; took %v.\n\n",
		cfg.name, env.desc, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version(), runtime.GOOS, runtime.GOARCH,
		time.Since(start).Round(time.Second))
	writeBenchTable(stdout, rows)
	fmt.Fprintf(stdout, "\nratio = coord ÷ plain etcd, of the figure named in brackets. "+
		"Latencies are p50 / p99 of sorted samples (nearest rank).\n")
	return errors.Join(failed...)
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
