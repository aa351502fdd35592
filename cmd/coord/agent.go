package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
)

func cmdAgent(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("agent", "", `Run an agent of the fleet until interrupted (Ctrl-C, SIGTERM): register
this host under --prefix, join the ShardSet under --shards-prefix (each
shard it owns runs until it must let go, a line printed at each start and
end), campaign in --elect KEY and hold a permit of --permit KEY if given,
and serve its health on --health ADDR if given (200 "ok" while every part
is healthy, 503 saying what is not; ?verbose lists each). Run two or three
in terminals of their own against "coord etcd", and watch them with coord
hosts, shards or ui. On interrupt it hands everything over at once: the
shards drained to their standbys, the leadership resigned, the permit
released, the host stopped.`, true)
	c.conn.registerPrefix(c.FlagSet)
	host, _ := os.Hostname()
	id := c.String("host-uuid", "", "the host's `UUID`; default: a new random one")
	name := c.String("hostname", host, "the host's `name`")
	shards := c.Int("shards", 12, "`number` of shards of the set: shard-00, shard-01, ...")
	shardsPrefix := c.String("shards-prefix", coord.ShardsPrefix, "etcd `prefix` of the ShardSet; ends in /")
	elect := c.String("elect", "", "election `KEY` to campaign in (default: none)")
	permit := c.String("permit", "", "semaphore `KEY` to hold a permit of (default: none)")
	limit := c.Int("limit", 1, "permits of the --permit semaphore: `N`")
	ttl := c.Duration("ttl", 10*time.Second, "TTL of every lease of the agent: a whole number of seconds")
	health := c.String("health", "", "`address` to serve the agent's health on (default: none)")
	if _, err := c.parse(args, stdout, 0); err != nil {
		return err
	}
	switch {
	case *shards < 1:
		return usagef("--shards %d: want at least 1", *shards)
	case !strings.HasSuffix(*shardsPrefix, "/"):
		return usagef("--shards-prefix %q must end in /", *shardsPrefix)
	case *ttl <= 0 || *ttl%time.Second != 0:
		return usagef("--ttl %v: want a positive whole number of seconds", *ttl)
	case *limit < 1:
		return usagef("--limit %d: want at least 1", *limit)
	}
	if *elect != "" {
		if err := checkElectionKey(*elect); err != nil {
			return err
		}
	}
	if *permit != "" {
		if err := checkKey("semaphore", *permit); err != nil {
			return err
		}
	}
	if *id == "" {
		*id = newUUID()
	}
	cli, err := c.conn.connect(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()
	a := &agent{cli: cli, out: stdout, checks: map[string]coord.Checker{}}
	defer a.handOver(c.conn.commandTimeout)
	if err := a.start(ctx, agentConfig{id: *id, name: *name, hostsPrefix: c.conn.prefix, shards: *shards,
		shardsPrefix: *shardsPrefix, elect: *elect, permit: *permit, limit: *limit, ttl: *ttl,
		timeout: c.conn.commandTimeout, log: c.conn.logger(stderr)}); err != nil {
		if ctx.Err() != nil {
			return nil // interrupted while starting
		}
		return err
	}
	if *health != "" {
		stop, err := a.serveHealth(*health, stderr)
		if err != nil {
			return err
		}
		defer stop()
	}
	fmt.Fprintf(stderr, "coord: agent %s (%s) running (Ctrl-C to hand everything over and stop)\n", *name, *id)
	select {
	case <-ctx.Done():
	case <-a.live.Done():
		return fmt.Errorf("host registration ended: %w", a.live.Err())
	}
	return nil
}

// agentConfig is what coord agent runs.
type agentConfig struct {
	id, name                  string
	hostsPrefix, shardsPrefix string
	shards                    int
	elect, permit             string
	limit                     int
	ttl, timeout              time.Duration
	log                       *slog.Logger
}

// agent is coord agent at work: its registration, shard set, election and
// semaphore, and the goroutines that hold them.
type agent struct {
	cli    *clientv3.Client
	out    io.Writer
	mu     sync.Mutex // serialises the lines printed
	live   *coord.HostLiveness
	set    *coord.ShardSet
	e      *coord.Election
	sem    *coord.Semaphore
	checks map[string]coord.Checker
	stop   context.CancelFunc // ends the campaign and permit loops
	loops  sync.WaitGroup
}

// printf prints a line of the agent's, timestamped.
func (a *agent) printf(format string, args ...any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	fmt.Fprintf(a.out, "%s  %s\n", time.Now().Format(timestamp), fmt.Sprintf(format, args...))
}

// start registers the host, starts the shard set, and the campaign and
// permit loops if asked, each within cfg.timeout.
func (a *agent) start(ctx context.Context, cfg agentConfig) error {
	sctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	var err error
	meta := coord.HostMetadata{HostUUID: cfg.id, Hostname: cfg.name, StartedAt: time.Now().UnixNano()}
	a.live, err = coord.RegisterHostLiveness(sctx, a.cli, meta, coord.LivenessOptions{Prefix: cfg.hostsPrefix, TTL: cfg.ttl, Logger: cfg.log})
	if err != nil {
		return err
	}
	a.checks["host"] = a.live
	a.printf("registered %s (%s) under %s", cfg.name, cfg.id, cfg.hostsPrefix)
	names := make([]string, cfg.shards)
	for i := range names {
		names[i] = fmt.Sprintf("shard-%02d", i)
	}
	a.set, err = coord.NewShardSet(sctx, a.cli, coord.ShardOptions{Prefix: cfg.shardsPrefix, Shards: names, Host: a.live,
		HostPrefix: cfg.hostsPrefix, TTL: cfg.ttl, Logger: cfg.log, Run: a.run})
	if err != nil {
		return err
	}
	a.checks["shards"] = a.set
	lctx, stop := context.WithCancel(context.Background())
	a.stop = stop
	if cfg.elect != "" {
		if a.e, err = coord.NewElection(sctx, a.cli, coord.ElectionOptions{Key: cfg.elect, TTL: cfg.ttl, Identity: cfg.name, Logger: cfg.log}); err != nil {
			return err
		}
		a.checks["election"] = a.e
		a.loops.Go(func() { a.lead(lctx, cfg.elect) })
	}
	if cfg.permit != "" {
		a.sem, err = coord.NewSemaphore(sctx, a.cli, coord.SemaphoreOptions{Key: cfg.permit, Limit: cfg.limit, TTL: cfg.ttl, Identity: cfg.name, Logger: cfg.log})
		if err != nil {
			return err
		}
		a.checks["permit"] = a.sem
		a.loops.Go(func() { a.hold(lctx, cfg.permit) })
	}
	return nil
}

// run is the ShardSet's Run: it holds the shard until told to let go.
func (a *agent) run(ctx context.Context, sh coord.Shard) {
	a.printf("running %s (token %d)", sh.Name, sh.Token)
	<-ctx.Done()
	a.printf("letting %s go (token %d): %v", sh.Name, sh.Token, context.Cause(ctx))
}

// lead campaigns in the election, and again after each leadership, until
// ctx ends.
func (a *agent) lead(ctx context.Context, key string) {
	for ctx.Err() == nil {
		if err := a.e.Campaign(ctx, ""); err != nil {
			if ctx.Err() == nil {
				a.printf("campaign in %s: %v", key, err)
				wait(ctx, time.Second) // a refusal: ask again later
			}
			continue
		}
		a.printf("leading %s (token %d)", key, a.e.Token())
		select {
		case <-a.e.Done():
			a.printf("leadership of %s ended: %v", key, a.e.Err())
		case <-ctx.Done():
		}
	}
}

// hold acquires a permit of the semaphore, and again after each one ends,
// until ctx ends.
func (a *agent) hold(ctx context.Context, key string) {
	for ctx.Err() == nil {
		p, err := a.sem.Acquire(ctx)
		if err != nil {
			if ctx.Err() == nil {
				a.printf("acquire %s: %v", key, err)
				wait(ctx, time.Second) // a refusal: ask again later
			}
			continue
		}
		a.printf("holding a permit of %s (token %d)", key, p.Token())
		select {
		case <-p.Done():
			a.printf("permit of %s ended: %v", key, p.Err())
		case <-ctx.Done():
			rctx, cancel := context.WithTimeout(context.Background(), time.Second)
			p.Release(rctx)
			cancel()
		}
	}
}

// serveHealth serves the agent's health on addr until the returned func
// is called.
func (a *agent) serveHealth(addr string, stderr io.Writer) (func(), error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("agent: health: %w", err)
	}
	srv := &http.Server{Handler: coord.HealthHandler(a.checks), ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintf(stderr, "coord: agent: health: %v\n", err)
		}
	}()
	fmt.Fprintf(stderr, "coord: agent health at http://%s/\n", ln.Addr())
	return func() {
		srv.Close()
		<-done
	}, nil
}

// handOver gives everything up at once, each step within timeout: the
// shards drained to their standbys (if another member can take them:
// the last one keeps them, and Close lets them go), the permit released
// and the leadership resigned, then everything closed and the host
// stopped.
func (a *agent) handOver(timeout time.Duration) {
	if a.stop != nil {
		a.stop()
		a.loops.Wait()
	}
	if a.set != nil {
		if len(a.set.Members()) > 1 {
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			if err := a.set.Drain(ctx); err != nil {
				a.printf("drain: %v", err)
			}
			cancel()
		}
		a.set.Close()
	}
	if a.e != nil {
		a.e.Close() // resigns
	}
	if a.sem != nil {
		a.sem.Close()
	}
	if a.live != nil {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		if err := a.live.Stop(ctx); err != nil {
			a.printf("stop: %v", err)
		}
		a.printf("handed everything over, stopped")
	}
}
