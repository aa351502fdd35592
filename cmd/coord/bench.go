package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/go-coord/coord/cmd/coord/internal/bench"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// cmdBench runs `coord bench`: failure detection, failover, watcher scale
// and etcd load, coord side by side with the plain etcd client code a user
// would write, in the same run on the same etcd. It prints a Markdown table
// on stdout and its progress on stderr. A scenario that fails gets a row
// saying so, and cmdBench then returns an error once the table is printed.
func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	a, err := benchParseFlags(args, stdout)
	if err != nil {
		return err
	}
	if a.render != nil {
		return benchRender(a.render, stdout)
	}
	cfg, out := a.cfg, a.json
	cfg.Progress = stderr
	if out == "" {
		return bench.Run(ctx, cfg, stdout)
	}
	// The report is written once the run is done: a run that fails
	// before its table leaves no file.
	var report bytes.Buffer
	cfg.JSON, cfg.Command = &report, "coord bench "+strings.Join(args, " ")
	err = bench.Run(ctx, cfg, stdout)
	if report.Len() > 0 {
		err = errors.Join(err, os.WriteFile(out, report.Bytes(), 0o644))
	}
	return err
}

// benchRender prints the table of the reports in files (see bench.Render).
func benchRender(files []string, stdout io.Writer) error {
	var reports []bench.Report
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		r, err := bench.ReadReport(b)
		if err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		reports = append(reports, r)
	}
	bench.Render(stdout, reports)
	return nil
}

// benchAbout is the help text of coord bench.
const benchAbout = `Measure coord side by side with the plain etcd client code a user would
write, in the same run on the same etcd, and print a Markdown table:
failure detection (crash and Stop → Down), failover (resign and leader
crash), watcher scale and churn, etcd load (lease renewals), campaign
throughput, a fleet of agents leading many keys, a ShardSet fleet
(scenario 10: shards spread over 32 hosts from a cold start, through a
join and a crash, next to every host campaigning for every shard on a
lease per shard, at a size where that fits), a semaphore (scenario 11:
Acquire → Release throughput under contention, and the handover to the
next waiter), and a wide fleet (scenario 12: 100 to 1,000 agents, their
watches straight to etcd or through etcd's gRPC proxy; then, in each
deployment, the etcd replaced by an empty one under the fleet, until
every agent is back, next to the same listings all at once straight to
etcd). Progress goes to stderr.

By default it starts an embedded single-member etcd in a temporary
directory, for the fleet (scenario 9) a 3-member one per side in a child
process, and for the wide fleet (scenario 12) one per size and
deployment in a child process, and the proxy in another. With
--endpoints it runs against that cluster instead (scenario 12 still on
its own), writing under /coord-bench/ and deleting what it wrote at the
end; it creates about 250 clients and, in the full run, 100,000 keys.
The full run takes about twenty minutes, --quick about one.

With --json FILE it also writes the run's figures to FILE, with when, on
which commit and on how busy a machine it ran. With --render FILE... it
runs nothing and prints the table of those files' runs, each scenario
from the latest run that has it, each row naming its run: the figures
of BENCHMARKS.md are made so.`

// benchArgs is what coord bench is asked: a run, and the file to write
// its report to (--json, "" if none); or, with --render, the reports to
// render (and no run).
type benchArgs struct {
	cfg    bench.Config
	json   string
	render []string
}

func benchParseFlags(args []string, stdout io.Writer) (benchArgs, error) {
	c := newCmdFlags("bench", "[FILE...]", benchAbout, true)
	c.optional = math.MaxInt32
	jsonOut := c.String("json", "", "also write the run's figures, and when and where it ran, to `file`, as JSON")
	renderFlag := c.Bool("render", false, "run nothing: print the table of the runs in the FILEs (written by --json)")
	full, quickCfg := bench.Full(), bench.Quick()
	quick := c.Bool("quick", false, "a short smoke run: small sizes and few samples, every row")
	only := c.String("only", "", fmt.Sprintf("comma-separated `numbers` of the scenarios to run, 1-%d (default all)", bench.Scenarios))
	shardTTL := c.Duration("shard-ttl", full.ShardTTL, "TTL of scenario 10's registrations and shard sessions, whole seconds (--quick: "+quickCfg.ShardTTL.String()+")")
	shardStagger := c.Duration("shard-stagger", full.ShardStagger, "pause between two hosts' starts in scenario 10's cold start; 0: all at once")
	files, err := c.parse(args, stdout, 0)
	switch {
	case err != nil:
		return benchArgs{}, err
	case *renderFlag && len(files) == 0:
		return benchArgs{}, usagef("--render: want the FILEs of the runs")
	case *renderFlag:
		return benchArgs{render: files}, nil
	case len(files) > 0:
		return benchArgs{}, usagef("unexpected argument %q (FILEs go with --render)", files[0])
	}
	cfg := full
	if *quick {
		cfg = quickCfg
	}
	if err := benchSetFlags(c, &cfg, *shardTTL, *shardStagger); err != nil {
		return benchArgs{}, err
	}
	if cfg.Etcd != nil {
		if err := c.conn.check(); err != nil {
			return benchArgs{}, err
		}
	}
	if cfg.Only, err = benchParseOnly(*only); err != nil {
		return benchArgs{}, err
	}
	if cfg.Etcd != nil {
		if *cfg.Etcd, err = benchRemoteConfig(c.conn); err != nil {
			return benchArgs{}, err
		}
	}
	return benchArgs{cfg: cfg, json: *jsonOut}, nil
}

// benchSetFlags lays the flags given on the command line over the preset
// cfg: those not given leave the preset's values (--quick's own TTL among
// them). --endpoints given marks cfg as run against that cluster.
func benchSetFlags(c *cmdFlags, cfg *bench.Config, shardTTL, shardStagger time.Duration) error {
	var err error
	c.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "endpoints":
			cfg.Etcd = &clientv3.Config{}
		case "shard-ttl":
			if shardTTL < time.Second || shardTTL%time.Second != 0 {
				err = usagef("--shard-ttl %v: want whole seconds, at least 1s", shardTTL)
			}
			cfg.ShardTTL = shardTTL
		case "shard-stagger":
			if shardStagger < 0 || shardStagger > 10*time.Second {
				err = usagef("--shard-stagger %v: want 0 to 10s", shardStagger)
			}
			cfg.ShardStagger = shardStagger
		}
	})
	return err
}

// benchParseOnly parses --only: scenario numbers, comma-separated.
func benchParseOnly(only string) ([]int, error) {
	var ns []int
	for _, s := range strings.Split(only, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > bench.Scenarios {
			return nil, usagef("--only: %q is not a scenario number (1-%d)", s, bench.Scenarios)
		}
		ns = append(ns, n)
	}
	return ns, nil
}

// benchRemoteConfig is the configuration of the clients of the cluster
// named by the connection flags.
func benchRemoteConfig(c *connFlags) (clientv3.Config, error) {
	tlsCfg, err := c.tlsConfig()
	if err != nil {
		return clientv3.Config{}, err
	}
	user, password, err := c.credentials()
	if err != nil {
		return clientv3.Config{}, err
	}
	return clientv3.Config{
		Endpoints:   c.endpointList(),
		DialTimeout: c.dialTimeout,
		TLS:         tlsCfg,
		Username:    user,
		Password:    password,
		Logger:      zap.NewNop(),
	}, nil
}
