package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-coord/coord"
	"github.com/go-coord/coord/coordtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

const (
	// demoTTL is the default TTL of the agents' leases and election
	// sessions (--ttl): the time it takes etcd to notice a crash. The
	// embedded etcd grants TTLs down to 1 s; 2 s leaves room for a slow
	// machine's renewals, and --ttl more.
	demoTTL      = 2 * time.Second
	demoElection = "/coord/elections/scheduler"
	// demoSemaphore is the Semaphore of the last act.
	demoSemaphore = "/coord/semaphores/maintenance"
	// demoWait bounds every wait of the demo at its default TTL (it
	// grows with the TTL): a step that takes longer is a failure, not
	// something to wait for.
	demoWait = 15 * time.Second
	// demoUIPace is how long each act's outcome stays on the page before
	// the next act.
	demoUIPace = time.Second
	// demoShards is the number of shards of the ShardSet act.
	demoShards = 12
)

func cmdDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("demo", "", `Run a self-contained demo of coord, in about ten seconds, with nothing to
set up: an embedded etcd, simulated agents (each with its own client)
registering their hosts with a 2s lease, and a watcher of the hosts.
First, an election that three of four agents contest: one host crashes,
then the leader crashes, and the demo shows, as it happens, the Down
events and the failover with their measured delays; a third agent stops
cleanly for comparison. Then a ShardSet: three more agents share 12
shards, a fourth joins and takes the shards it ranks first for, the agent
that owns most drains (Drain hands its shards over, then Close), then the
one that owns most of the rest crashes and its shards go to their
standbys; the demo prints each move with its delay, and checks that no
shard ever ran on two agents at once. Last, four agents share a Semaphore
of two permits: two hold, two wait in line, a holder crashes and its
permit ends before its slot goes to the first in line. A crash is
simulated by closing the agent's client without stopping anything, so
its leases are left to expire.

With --endpoints, the acts run against that etcd instead of an embedded
one: an etcd of its own (coord etcd, say), as the demo writes under /coord/
and expects nothing of another fleet there.`, true)
	ui := demoUIFlag(c)
	ttl := c.Duration("ttl", demoTTL, "`TTL` of the agents' leases and sessions, 1s or more (a slow machine: longer)")
	pos, err := c.parse(args, stdout, 0)
	if err != nil {
		return err
	}
	if err := ui.address(pos); err != nil {
		return err
	}
	if *ttl < time.Second || *ttl%time.Second != 0 {
		return usagef("--ttl %v: want whole seconds, 1s or more", *ttl)
	}
	external := false
	c.Visit(func(f *flag.Flag) { external = external || f.Name == "endpoints" })
	if !external {
		return runDemo(ctx, stdout, ui.addr, *ttl, nil)
	}
	if err := c.conn.check(); err != nil {
		return err
	}
	var (
		mu      sync.Mutex
		clients []*clientv3.Client
	)
	// Every client dialled is closed at the end, the crashed agents' again
	// (harmless), as the embedded etcd's Close does.
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, cli := range clients {
			cli.Close()
		}
	}()
	return runDemo(ctx, stdout, ui.addr, *ttl, &demoEtcd{
		endpoint: strings.Join(c.conn.endpointList(), ","),
		dial: func() (*clientv3.Client, error) {
			cli, err := c.conn.connect(ctx)
			if err == nil {
				mu.Lock()
				clients = append(clients, cli)
				mu.Unlock()
			}
			return cli, err
		},
	})
}

// demoEtcd is the etcd of the demo: where it is, and how an agent dials
// it (a client of its own each).
type demoEtcd struct {
	endpoint string
	dial     func() (*clientv3.Client, error)
}

// demoAgent is a simulated agent: a host with its own etcd client.
type demoAgent struct {
	name  string
	meta  coord.HostMetadata
	cli   *clientv3.Client
	live  *coord.HostLiveness
	elect *coord.Election  // nil unless a candidate
	set   *coord.ShardSet  // nil unless it takes part in the shards
	sem   *coord.Semaphore // nil unless it takes part in the semaphore
	up    chan struct{}    // the watcher saw the host up
	down  chan struct{}    // the watcher saw the host down
}

// demoOutcome is the outcome of a Campaign run in the background.
type demoOutcome struct {
	agent *demoAgent
	err   error
	at    time.Time // when Campaign returned
}

// demoGrant is the outcome of an Acquire run in the background.
type demoGrant struct {
	agent  *demoAgent
	permit *coord.Permit
	err    error
	at     time.Time // when Acquire returned
}

type demo struct {
	ttl    time.Duration // of the agents' leases and sessions
	wait   time.Duration // bounds every wait
	pace   time.Duration // how long each act's outcome stays before the next act: on the page only
	log    *demoLog
	etcd   *demoEtcd
	agents []*demoAgent
	byUUID map[string]*demoAgent // fixed before the watcher starts
	cli    *clientv3.Client      // the watcher's, also used to look around
	w      *coord.HostWatcher
	leads  chan demoOutcome
	grants chan demoGrant // the semaphore's Acquires run in the background
	wg     sync.WaitGroup // the watcher's consumer, the campaigns and the Acquires

	shards []string // the ShardSet's

	mu      sync.Mutex
	marks   map[*demoAgent]demoMark // when and how an agent went
	results []demoResult            // the summary
	// What the shard signals told, by shard: the agent whose Run runs it,
	// the agent that ran it last and when that Run returned; every change
	// of owner, and the first shard seen run by two agents at once.
	running  map[string]*demoAgent
	lastRun  map[string]*demoAgent
	returned map[string]time.Time
	moves    []shardMove
	overlap  error
}

// shardMove is a shard passing from one agent's Run to another's.
type shardMove struct {
	shard    string
	from, to *demoAgent
	gap      time.Duration // from the Run of from returning to the Run of to starting
	at       time.Time     // when the Run of to started
}

// runDemo runs the demo on etcd, an embedded one if nil.
func runDemo(ctx context.Context, stdout io.Writer, uiAddr string, ttl time.Duration, etcd *demoEtcd) (err error) {
	start := time.Now()
	log := &demoLog{w: stdout}
	const cast = "4 agents, 3 of them in an election; a ShardSet of 4 more; a Semaphore of 4 more; with a drain and crashes"
	if etcd == nil {
		dir, err := os.MkdirTemp("", "coord-demo-")
		if err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		defer os.RemoveAll(dir)
		log.printf("demo", "on an embedded etcd: "+cast)
		log.printf("demo", "starting the embedded etcd")
		srv, err := coordtest.Start(dir, coordtest.Config{})
		if err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		defer srv.Close()
		etcd = &demoEtcd{endpoint: srv.Endpoint(), dial: srv.Dial}
	} else {
		log.printf("demo", "on the etcd at %s: "+cast, etcd.endpoint)
	}
	log.printf("demo", "etcd ready at %s", etcd.endpoint)
	if uiAddr != "" {
		stopUI, err := startDemoUI(ctx, etcd, uiAddr, log)
		if err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		defer stopUI()
	}

	d := &demo{log: log, etcd: etcd, ttl: ttl, wait: time.Duration(float64(demoWait) * float64(ttl) / float64(demoTTL)), byUUID: map[string]*demoAgent{}, marks: map[*demoAgent]demoMark{},
		running: map[string]*demoAgent{}, lastRun: map[string]*demoAgent{}, returned: map[string]time.Time{}}
	defer func() {
		if serr := d.shutdown(); err == nil {
			err = serr
		}
		if err == nil {
			log.printf("demo", "done in %.1fs", time.Since(start).Seconds())
		}
	}()
	if uiAddr != "" {
		d.pace = demoUIPace
	}
	if err := d.script(ctx); err != nil {
		if ctx.Err() != nil {
			return errors.New("demo interrupted")
		}
		return fmt.Errorf("demo: %w", err)
	}
	if uiAddr != "" {
		// The page shows the fleet the acts left, for as long as one
		// likes.
		log.printf("demo", "the acts are over; the page stays until Ctrl-C")
		<-ctx.Done()
	}
	return nil
}

// script is the demo proper, act by act; shutdown cleans up after it,
// whatever happened.
func (d *demo) script(ctx context.Context) error {
	d.cast()
	if err := d.startWatcher(ctx); err != nil {
		return err
	}
	for _, a := range d.agents[:4] {
		if err := d.register(ctx, a); err != nil {
			return err
		}
	}
	n1, n2, n3, n4 := d.agents[0], d.agents[1], d.agents[2], d.agents[3]
	acts := []func(context.Context) error{
		func(ctx context.Context) error { return d.electionAct(ctx, n1, n2, n3) },
		func(ctx context.Context) error { return d.hostCrashAct(ctx, n4) },
		func(ctx context.Context) error { return d.leaderCrashAct(ctx, n1, n2) },
		func(ctx context.Context) error { return d.stopAct(ctx, n3) },
		func(ctx context.Context) error { return d.leaveAct(ctx, n2) },
		d.shardAct,
		func(ctx context.Context) error { return d.semaphoreAct(ctx, d.agents[8:]) },
	}
	for _, act := range acts {
		if err := act(ctx); err != nil {
			return err
		}
		// On the page, each act's outcome stays a moment before the
		// next one changes it (a leader that resigns right after its
		// failover would never be seen leading).
		if !wait(ctx, d.pace) {
			return ctx.Err()
		}
	}
	d.summary()
	return nil
}

// cast creates the agents, four for the election, four for the ShardSet
// and four for the Semaphore, and names the shards.
func (d *demo) cast() {
	zones := []string{"eu-west-1a", "eu-west-1b"}
	for i := range 12 {
		a := &demoAgent{
			name: fmt.Sprintf("node-%d", i+1),
			up:   make(chan struct{}, 1),
			down: make(chan struct{}, 1),
		}
		a.meta = coord.HostMetadata{HostUUID: newUUID(), Hostname: a.name, Version: "1.4.2",
			Labels: map[string]string{"zone": zones[i%2]}}
		d.agents = append(d.agents, a)
		d.byUUID[a.meta.HostUUID] = a
	}
	for i := range demoShards {
		d.shards = append(d.shards, fmt.Sprintf("shard-%02d", i))
	}
}

// electionAct has leader lead the election, then next and last queue
// behind it in that order.
func (d *demo) electionAct(ctx context.Context, leader, next, last *demoAgent) error {
	d.log.printf("demo", "%s, %s and %s campaign in election %s (session TTL %v)", leader.name, next.name, last.name, demoElection, d.ttl)
	d.leads = make(chan demoOutcome, len(d.agents))
	for _, a := range []*demoAgent{leader, next, last} {
		e, err := coord.NewElection(ctx, a.cli, coord.ElectionOptions{Key: demoElection, TTL: d.ttl, Identity: a.name})
		if err != nil {
			return fmt.Errorf("%s: %w", a.name, err)
		}
		a.elect = e
	}
	if err := leader.elect.Campaign(ctx, ""); err != nil {
		return fmt.Errorf("%s: %w", leader.name, err)
	}
	d.log.printf(leader.name, "leads %s (fencing token %d: etcd's revision of the leader key, rising with each leader; a write guarded by it fails once another leads)", demoElection, leader.elect.Token())
	// One at a time, so that the queue, and the successor, are known.
	d.campaign(ctx, next)
	if err := d.waitCandidates(ctx, 2); err != nil {
		return err
	}
	d.log.printf(next.name, "campaigns; waits in line behind %s", leader.name)
	d.campaign(ctx, last)
	if err := d.waitCandidates(ctx, 3); err != nil {
		return err
	}
	d.log.printf(last.name, "campaigns; waits in line behind %s and %s", leader.name, next.name)
	return nil
}

// hostCrashAct crashes a, which takes no part in the election, and
// reports when the watcher saw it down.
func (d *demo) hostCrashAct(ctx context.Context, a *demoAgent) error {
	d.log.printf("demo", "--- %s crashes: its process dies, its lease is left to expire (TTL %v)", a.name, a.live.TTL())
	d.log.printf("demo", "    a lease counts its TTL from its last renewal, which came before the crash: Down can come a little under the TTL after it")
	d.crash(a)
	if err := d.await(ctx, a.down, a.name+" seen down"); err != nil {
		return err
	}
	d.result(a.name+" crash -> Down seen by the watcher", d.since(a))
	return nil
}

// leaderCrashAct crashes the leader and waits both for the watcher to see
// it down and for next, first in line, to lead.
func (d *demo) leaderCrashAct(ctx context.Context, leader, next *demoAgent) error {
	leaderToken := leader.elect.Token()
	d.log.printf("demo", "--- %s, the leader, crashes: its host lease and election session are left to expire", leader.name)
	d.crash(leader)
	downSeen, led := false, false
	timeout := time.After(d.wait)
	for !downSeen || !led {
		select {
		case <-leader.down:
			downSeen = true
			d.result(leader.name+" (leader) crash -> Down seen by the watcher", d.since(leader))
		case r := <-d.leads:
			if err := d.failedOver(r, leader, next, leaderToken); err != nil {
				return err
			}
			led = true
		case <-ctx.Done():
			return ctx.Err()
		case <-timeout:
			return fmt.Errorf("no failover from %s within %v", leader.name, d.wait)
		}
	}
	return nil
}

// failedOver checks and reports the outcome r of a campaign once the
// leader, whose fencing token was token, has crashed: next should lead.
func (d *demo) failedOver(r demoOutcome, leader, next *demoAgent, token int64) error {
	if r.err != nil {
		return fmt.Errorf("%s: %w", r.agent.name, r.err)
	}
	if r.agent != next {
		return fmt.Errorf("%s leads, %s was next in line", r.agent.name, next.name)
	}
	ms := d.sinceAt(leader, r.at)
	if ms < 0 {
		// The leader stepped down by itself before the crash: its
		// renewals were late (a machine too slow for the TTL).
		return fmt.Errorf("%s led before %s crashed: %s lost its leadership early", next.name, leader.name, leader.name)
	}
	d.log.printf(next.name, "leads %s (fencing token %d > %d): %d ms after %s crashed", demoElection, next.elect.Token(), token, ms, leader.name)
	d.result(leader.name+" (leader) crash -> "+next.name+" leads", ms)
	return nil
}

// stopAct stops a cleanly, for comparison with the crashes.
func (d *demo) stopAct(ctx context.Context, a *demoAgent) error {
	d.log.printf("demo", "--- %s stops cleanly: Stop revokes its lease, Close withdraws its candidacy", a.name)
	d.mark(a, "Stop")
	if err := a.live.Stop(ctx); err != nil {
		return fmt.Errorf("%s: %w", a.name, err)
	}
	if err := d.await(ctx, a.down, a.name+" seen down"); err != nil {
		return err
	}
	d.result(a.name+" Stop -> Down seen by the watcher", d.since(a))
	if err := a.elect.Close(); err != nil {
		return fmt.Errorf("%s: %w", a.name, err)
	}
	return nil
}

// leaveAct has a, the last of the election's agents, resign and stop. A
// ShardSet ranks every live host under its host prefix, whether it takes
// part or not: a leaves the fleet to the ShardSet's hosts.
func (d *demo) leaveAct(ctx context.Context, a *demoAgent) error {
	d.log.printf("demo", "--- %s, the last of the election's agents, resigns and stops", a.name)
	if err := a.elect.Close(); err != nil {
		return fmt.Errorf("%s: %w", a.name, err)
	}
	d.mark(a, "Stop")
	if err := a.live.Stop(ctx); err != nil {
		return fmt.Errorf("%s: %w", a.name, err)
	}
	return d.await(ctx, a.down, a.name+" seen down")
}

// summary prints the measured delays.
func (d *demo) summary() {
	d.mu.Lock()
	lines := d.results
	d.mu.Unlock()
	d.log.printf("demo", "summary (lease and session TTL %v, counted from the last renewal before a crash; etcd checks expiries every 500 ms):", d.ttl)
	width := 0
	for _, l := range lines {
		width = max(width, len(l.what))
	}
	for _, l := range lines {
		d.log.raw(fmt.Sprintf("%23s%-*s %5d ms", "", width, l.what, l.ms))
	}
}

// shardAct is the ShardSet's part of the demo: three agents share the
// shards, a fourth joins, then the one that owns most crashes. Where each
// shard must go is known in advance (shardRank): the demo waits for that,
// then prints the moves that took it there, and checks that there were no
// others.
func (d *demo) shardAct(ctx context.Context) error {
	fleet := d.agents[4:8]
	before, err := d.shardStart(ctx, fleet[:3])
	if err != nil {
		return err
	}
	after, err := d.shardJoin(ctx, fleet, before)
	if err != nil {
		return err
	}
	rest, drained, err := d.shardDrain(ctx, fleet, after)
	if err != nil {
		return err
	}
	if err := d.shardCrash(ctx, rest, drained); err != nil {
		return err
	}
	d.log.printf("shards", "no shard ever ran on two hosts at once: each Run started after the previous owner's had returned")
	return nil
}

// shardStart registers the first agents and starts their ShardSets, and
// returns the owners once settled.
func (d *demo) shardStart(ctx context.Context, first []*demoAgent) (map[string]*demoAgent, error) {
	d.log.printf("demo", "--- ShardSet: %s, %s and %s share %d shards, each an election under %s; each shard is",
		first[0].name, first[1].name, first[2].name, len(d.shards), coord.ShardsPrefix)
	d.log.printf("demo", "    owned by the live host that ranks first for it (rendezvous hashing), the next-ranked in line as its standby")
	for _, a := range first {
		if err := d.register(ctx, a); err != nil {
			return nil, err
		}
	}
	for _, a := range first {
		if err := d.startShards(ctx, a); err != nil {
			return nil, err
		}
	}
	before, err := d.settle(ctx, first)
	if err != nil {
		return nil, err
	}
	d.log.printf("shards", "settled: every shard owned by its top-ranked host, the next-ranked in line")
	d.printOwners(first, before)
	return before, nil
}

// shardJoin has the last agent of fleet join the others, whose shards'
// owners were before, and returns the owners once settled.
func (d *demo) shardJoin(ctx context.Context, fleet []*demoAgent, before map[string]*demoAgent) (map[string]*demoAgent, error) {
	joiner := fleet[len(fleet)-1]
	d.log.printf("demo", "--- %s joins: the shards it ranks first for move to it (about %d/%d), no other shard moves",
		joiner.name, len(d.shards), len(fleet))
	if err := d.register(ctx, joiner); err != nil {
		return nil, err
	}
	mark := d.moveCount()
	if err := d.startShards(ctx, joiner); err != nil {
		return nil, err
	}
	after, err := d.settle(ctx, fleet)
	if err != nil {
		return nil, err
	}
	moved, err := d.checkMoves(mark, before, after)
	if err != nil {
		return nil, fmt.Errorf("%s joined: %w", joiner.name, err)
	}
	var longest time.Duration
	for _, m := range d.movesSince(mark) {
		longest = max(longest, m.gap)
		d.log.printf("shards", "%s: %s -> %s, owned again %d ms after %s let go", m.shard, m.from.name, m.to.name, m.gap.Milliseconds(), m.from.name)
	}
	if len(moved) == 0 {
		// A fair draw: 12 shards miss one host of 4 about 3% of the time.
		d.log.printf("shards", "join: %s ranks first for none of the %d shards: none moved", joiner.name, len(d.shards))
	} else {
		d.log.printf("shards", "join: %d of %d shards moved, all to %s; the other %d stayed put", len(moved), len(d.shards), joiner.name, len(d.shards)-len(moved))
	}
	d.printOwners(fleet, after)
	if len(moved) > 0 {
		d.result(joiner.name+" joins -> a moved shard owned again, longest gap", longest.Milliseconds())
	}
	return after, nil
}

// shardDrain has the agent of fleet that owns the most shards, by after,
// leave gracefully, as for a planned restart: Drain hands its shards over
// to their standbys, then Close and Stop. It returns the others and the
// owners once settled.
func (d *demo) shardDrain(ctx context.Context, fleet []*demoAgent, after map[string]*demoAgent) ([]*demoAgent, map[string]*demoAgent, error) {
	leaver := slices.MaxFunc(fleet, func(a, b *demoAgent) int { return cmp.Compare(ownedBy(after, a), ownedBy(after, b)) })
	rest := slices.DeleteFunc(slices.Clone(fleet), func(a *demoAgent) bool { return a == leaver })
	d.log.printf("demo", "--- %s, owning %d shards, leaves for a planned restart: Drain hands each to its standby, then Close",
		leaver.name, ownedBy(after, leaver))
	mark := d.moveCount()
	start := time.Now()
	dctx, cancel := context.WithTimeout(ctx, d.wait)
	err := leaver.set.Drain(dctx)
	cancel()
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", leaver.name, err)
	}
	took := time.Since(start)
	final, err := d.settle(ctx, rest)
	if err != nil {
		return nil, nil, err
	}
	moved, err := d.checkMoves(mark, after, final)
	if err != nil {
		return nil, nil, fmt.Errorf("%s drained: %w", leaver.name, err)
	}
	moves := d.movesSince(mark)
	var longest time.Duration
	for _, m := range moves {
		longest = max(longest, m.gap)
		d.log.printf("shards", "%s: %s -> %s, handed over: owned again %d ms after %s released it", m.shard, m.from.name, m.to.name, m.gap.Milliseconds(), m.from.name)
	}
	d.log.printf("shards", "drain: Drain returned in %d ms, owning nothing; %d shards handed over, at most %d in flight at once (bound: MaxMoves = %d per taker)",
		took.Milliseconds(), len(moved), maxInFlight(moves), coord.DefaultShardMaxMoves)
	d.log.printf("shards", "drain: no shard went without an owner longer than %d ms: its Run's drain (none, it returns at once) plus a round trip",
		longest.Milliseconds())
	if err := d.leave(ctx, leaver); err != nil {
		return nil, nil, err
	}
	d.printOwners(rest, final)
	d.result(leaver.name+" Drain -> returns, owning nothing", took.Milliseconds())
	if len(moves) > 0 {
		d.result(leaver.name+" Drain -> a shard without an owner, longest", longest.Milliseconds())
	}
	return rest, final, nil
}

// leave closes a's drained ShardSet, which has nothing more to hand
// over, and stops its host.
func (d *demo) leave(ctx context.Context, a *demoAgent) error {
	mark := d.moveCount()
	if err := a.set.Close(); err != nil {
		return fmt.Errorf("%s: %w", a.name, err)
	}
	if n := d.moveCount() - mark; n > 0 {
		return fmt.Errorf("%s: Close after Drain moved %d shards", a.name, n)
	}
	d.log.printf(a.name, "closes its ShardSet (Done closed, Err %v): nothing more to hand over; stops its host", a.set.Err())
	d.mark(a, "Stop")
	if err := a.live.Stop(ctx); err != nil {
		return fmt.Errorf("%s: %w", a.name, err)
	}
	return d.await(ctx, a.down, a.name+" seen down")
}

// maxInFlight returns the most moves under way at once: released by one
// agent, not yet acquired by the next.
func maxInFlight(moves []shardMove) int {
	most := 0
	for _, m := range moves {
		n := 0
		for _, o := range moves {
			if !o.at.Before(m.at) && !o.at.Add(-o.gap).After(m.at) {
				n++
			}
		}
		most = max(most, n)
	}
	return most
}

// shardCrash crashes the agent of fleet that owns the most shards, by
// after, and checks that only its shards move, to their standbys.
func (d *demo) shardCrash(ctx context.Context, fleet []*demoAgent, after map[string]*demoAgent) error {
	victim := slices.MaxFunc(fleet, func(a, b *demoAgent) int { return cmp.Compare(ownedBy(after, a), ownedBy(after, b)) })
	rest := slices.DeleteFunc(slices.Clone(fleet), func(a *demoAgent) bool { return a == victim })
	d.log.printf("demo", "--- %s, owning %d shards, crashes: its leases are left to expire (TTL %v); each of its shards has a standby in line",
		victim.name, ownedBy(after, victim), d.ttl)
	mark := d.moveCount()
	d.crash(victim)
	final, err := d.settle(ctx, rest)
	if err != nil {
		return err
	}
	moved, err := d.checkMoves(mark, after, final)
	if err != nil {
		return fmt.Errorf("%s crashed: %w", victim.name, err)
	}
	var delays []int64
	for _, m := range d.movesSince(mark) {
		ms := d.sinceAt(victim, m.at)
		delays = append(delays, ms)
		d.log.printf("shards", "%s: %s -> %s, owned again %d ms after the crash", m.shard, m.from.name, m.to.name, ms)
	}
	d.log.printf("shards", "crash: the %d shards %s owned moved to their standbys; no other shard moved", len(moved), victim.name)
	d.printOwners(rest, final)
	if len(delays) > 0 {
		d.result(victim.name+" crash -> its shards owned again, first", slices.Min(delays))
		d.result(victim.name+" crash -> its shards owned again, last", slices.Max(delays))
	}
	return nil
}

// startShards starts a's ShardSet. Its Run does nothing but wait for its
// ctx to end: the demo follows the shards through their signals.
func (d *demo) startShards(ctx context.Context, a *demoAgent) error {
	set, err := coord.NewShardSet(ctx, a.cli, coord.ShardOptions{
		Shards:   d.shards,
		Host:     a.live,
		TTL:      d.ttl,
		Run:      func(ctx context.Context, _ coord.Shard) { <-ctx.Done() },
		OnSignal: d.onShardSignal,
	})
	if err != nil {
		return fmt.Errorf("%s: %w", a.name, err)
	}
	a.set = set
	d.log.printf(a.name, "starts its ShardSet (session TTL %v)", d.ttl)
	return nil
}

// onShardSignal follows the Runs of the shards: it notes every change of
// owner, and the first shard seen run by two agents at once. The
// signals of one shard are causally ordered: a Run's end is signalled
// before its owner resigns, which the next owner waits for.
func (d *demo) onShardSignal(sig coord.Signal) {
	if sig.Kind != coord.SignalShardAcquired && sig.Kind != coord.SignalShardReleased {
		return
	}
	a, now := d.byUUID[sig.Host], time.Now()
	d.mu.Lock()
	defer d.mu.Unlock()
	if sig.Kind == coord.SignalShardReleased {
		if d.running[sig.Shard] == a {
			delete(d.running, sig.Shard)
		}
		d.returned[sig.Shard] = now
		return
	}
	if r := d.running[sig.Shard]; r != nil && d.overlap == nil {
		d.overlap = fmt.Errorf("%s: %s started it while %s still ran it", sig.Shard, a.name, r.name)
	}
	d.running[sig.Shard] = a
	if from := d.lastRun[sig.Shard]; from != nil && from != a {
		d.moves = append(d.moves, shardMove{sig.Shard, from, a, now.Sub(d.returned[sig.Shard]), now})
	}
	d.lastRun[sig.Shard] = a
}

func (d *demo) moveCount() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.moves)
}

// movesSince returns the moves from the i-th on, by shard, each shard's
// in order.
func (d *demo) movesSince(i int) []shardMove {
	d.mu.Lock()
	ms := slices.Clone(d.moves[i:])
	d.mu.Unlock()
	slices.SortStableFunc(ms, func(a, b shardMove) int { return strings.Compare(a.shard, b.shard) })
	return ms
}

// checkMoves checks the moves from the i-th on against the owners before
// and after: each shard whose owner changed went from one to the other
// (through another on the way, at worst: a handover may race with a
// candidacy), and no other shard moved. It returns the shards that moved.
func (d *demo) checkMoves(i int, before, after map[string]*demoAgent) ([]string, error) {
	by := map[string][]shardMove{}
	for _, m := range d.movesSince(i) {
		by[m.shard] = append(by[m.shard], m)
	}
	var moved []string
	for _, s := range d.shards {
		ms := by[s]
		switch {
		case before[s] == after[s] && len(ms) > 0:
			return nil, fmt.Errorf("%s moved from %s to %s, it should have stayed", s, ms[0].from.name, ms[0].to.name)
		case before[s] == after[s]:
		case len(ms) == 0 || ms[0].from != before[s] || ms[len(ms)-1].to != after[s]:
			return nil, fmt.Errorf("%s should have moved from %s to %s, moves seen: %d", s, before[s].name, after[s].name, len(ms))
		default:
			moved = append(moved, s)
		}
	}
	return moved, nil
}

// settle waits until the shards are where rendezvous hashing puts them
// among the live agents: etcd holds, for each shard, the candidacies of
// the two agents that rank first for it, the first one's first; the first
// one's Run runs it, and no other agent's. It returns the owners.
func (d *demo) settle(ctx context.Context, live []*demoAgent) (map[string]*demoAgent, error) {
	var ids []string
	for _, a := range live {
		ids = append(ids, a.meta.HostUUID)
	}
	want := map[string][]string{}
	owners := map[string]*demoAgent{}
	for _, s := range d.shards {
		r := shardRank(s, ids)
		want[s] = r[:min(coord.DefaultShardReplicas, len(r))]
		owners[s] = d.byUUID[r[0]]
	}
	ctx, cancel := context.WithTimeout(ctx, d.wait)
	defer cancel()
	for {
		diff, err := d.placed(ctx, want)
		if err == nil && diff == "" {
			d.mu.Lock()
			defer d.mu.Unlock()
			return owners, d.overlap
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = errors.New(diff)
			}
			return nil, fmt.Errorf("shards not placed by rendezvous hashing within %v: %w", d.wait, err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// placed says how the shards differ from want, by shard the HostUUIDs of
// its candidates, the owner first: "" if they do not.
func (d *demo) placed(ctx context.Context, want map[string][]string) (string, error) {
	infos, err := listShards(ctx, d.cli, coord.ShardsPrefix, coord.HostsPrefix, io.Discard)
	if err != nil {
		return "", err
	}
	names := func(ids []string) string {
		var ns []string
		for _, id := range ids {
			if a := d.byUUID[id]; a != nil {
				id = a.name
			}
			ns = append(ns, id)
		}
		return strings.Join(ns, ", ")
	}
	found := map[string][]string{}
	for _, info := range infos {
		found[info.Shard] = []string{info.Owner.Identity}
		for _, c := range info.Standbys {
			found[info.Shard] = append(found[info.Shard], c.Identity)
		}
	}
	for _, s := range d.shards {
		if !slices.Equal(found[s], want[s]) {
			return fmt.Sprintf("%s: candidates [%s], want [%s]", s, names(found[s]), names(want[s])), nil
		}
	}
	if len(found) != len(want) {
		return fmt.Sprintf("%d shards in etcd, want %d", len(found), len(want)), nil
	}
	running := map[string]bool{}
	for _, a := range d.agents {
		if a.set == nil {
			continue
		}
		for _, sh := range a.set.Owned() {
			if want[sh.Name][0] != a.meta.HostUUID {
				return fmt.Sprintf("%s: run by %s, want %s", sh.Name, a.name, names(want[sh.Name][:1])), nil
			}
			running[sh.Name] = true
		}
	}
	// Owned shows a shard as soon as it is acquired, its signal just
	// after: the moves are counted from the signals.
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, s := range d.shards {
		if r := d.running[s]; !running[s] || r == nil || r.meta.HostUUID != want[s][0] {
			return fmt.Sprintf("%s: not run by %s", s, names(want[s][:1])), nil
		}
	}
	return "", nil
}

// printOwners prints the shards each of agents owns, a line each, with
// no other line in between.
func (d *demo) printOwners(agents []*demoAgent, owners map[string]*demoAgent) {
	var lines [][2]string
	for _, a := range agents {
		var mine []string
		for _, s := range d.shards {
			if owners[s] == a {
				mine = append(mine, s)
			}
		}
		lines = append(lines, [2]string{a.name, strings.TrimSpace(fmt.Sprintf("owns %2d: %s", len(mine), strings.Join(mine, " ")))})
	}
	d.log.lines(lines)
}

// ownedBy returns how many shards owners gives a.
func ownedBy(owners map[string]*demoAgent, a *demoAgent) int {
	n := 0
	for _, o := range owners {
		if o == a {
			n++
		}
	}
	return n
}

// shardRank returns hosts ranked for shard, best first, as every
// ShardSet ranks them. Rendezvous hashing needs no coordination: any
// program can compute the placement, so the demo knows where each shard
// must go, and checks that it went there.
func shardRank(shard string, hosts []string) []string { return coord.RankHosts(shard, hosts) }

// startWatcher starts the host watcher, on its own client, and a consumer
// that prints its events.
func (d *demo) startWatcher(ctx context.Context) error {
	cli, err := d.etcd.dial()
	if err != nil {
		return err
	}
	d.cli = cli
	w, err := coord.NewHostWatcher(ctx, cli, coord.WatcherOptions{})
	if err != nil {
		return err
	}
	d.w = w
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		for ev := range w.Events() {
			d.onEvent(ev)
		}
	}()
	if err := d.await(ctx, w.Synced(), "watcher synced"); err != nil {
		return err
	}
	d.log.printf("watcher", "watching %s: %d hosts", coord.HostsPrefix, len(w.Hosts()))
	return nil
}

func (d *demo) onEvent(ev coord.HostEvent) {
	a := d.byUUID[ev.HostUUID]
	if a == nil {
		d.log.printf("watcher", "%s", formatEvent(ev))
		return
	}
	what := fmt.Sprintf("%-4s %s (%.8s…)", ev.Kind, a.name, ev.HostUUID)
	switch ev.Kind {
	case coord.HostUp:
		d.log.printf("watcher", "%s", what)
		notify(a.up)
	case coord.HostDown:
		d.mu.Lock()
		m, ok := d.marks[a]
		d.mu.Unlock()
		if ok {
			what += fmt.Sprintf(": %d ms after its %s", time.Since(m.at).Milliseconds(), m.how)
		}
		d.log.printf("watcher", "%s", what)
		notify(a.down)
	default:
		d.log.printf("watcher", "%s", what)
	}
}

func notify(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// register gives a its own client and registers its host, and waits for
// the watcher to see it.
func (d *demo) register(ctx context.Context, a *demoAgent) error {
	cli, err := d.etcd.dial()
	if err != nil {
		return err
	}
	a.cli = cli
	a.meta.StartedAt = time.Now().UnixNano()
	d.log.printf(a.name, "registers host %s (zone %s, lease TTL %v)", a.meta.HostUUID, a.meta.Labels["zone"], d.ttl)
	a.live, err = coord.RegisterHostLiveness(ctx, cli, a.meta, coord.LivenessOptions{TTL: d.ttl})
	if err != nil {
		return fmt.Errorf("%s: %w", a.name, err)
	}
	return d.await(ctx, a.up, a.name+" seen up")
}

// campaign runs a's Campaign in the background; its outcome goes to
// d.leads.
func (d *demo) campaign(ctx context.Context, a *demoAgent) {
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		err := a.elect.Campaign(ctx, "")
		d.leads <- demoOutcome{a, err, time.Now()}
	}()
}

// waitCandidates waits until n candidates are in line for the election.
func (d *demo) waitCandidates(ctx context.Context, n int) error {
	return d.waitKeys(ctx, demoElection+"/", n)
}

// waitKeys waits until there are n keys under prefix: candidates in
// line for an election or a semaphore.
func (d *demo) waitKeys(ctx context.Context, prefix string, n int) error {
	ctx, cancel := context.WithTimeout(ctx, d.wait)
	defer cancel()
	for {
		resp, err := d.cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			return fmt.Errorf("waiting for %d candidates: %w", n, err)
		}
		if resp.Count >= int64(n) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %d candidates: %w", n, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// crash simulates the death of a's process: its client goes, nothing is
// stopped or revoked, so etcd expires its leases after their TTL.
func (d *demo) crash(a *demoAgent) {
	d.mark(a, "crash")
	a.cli.Close()
}

// demoMark says when and how an agent went.
type demoMark struct {
	at  time.Time
	how string // "crash" or "Stop"
}

func (d *demo) mark(a *demoAgent, how string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.marks[a] = demoMark{time.Now(), how}
}

// since returns the milliseconds since a crashed or stopped, -1 if it has
// not.
func (d *demo) since(a *demoAgent) int64 {
	return d.sinceAt(a, time.Now())
}

// sinceAt returns the milliseconds from a's crash or stop to t: negative
// if t came before it, -1 if a has not gone.
func (d *demo) sinceAt(a *demoAgent, t time.Time) int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	m, ok := d.marks[a]
	if !ok {
		return -1
	}
	return t.Sub(m.at).Milliseconds()
}

// demoResult is a measured delay.
type demoResult struct {
	what string
	ms   int64
}

func (d *demo) result(what string, ms int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.results = append(d.results, demoResult{what, ms})
}

func (d *demo) await(ctx context.Context, ch <-chan struct{}, what string) error {
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d.wait):
		return fmt.Errorf("%s: not within %v", what, d.wait)
	}
}

// shutdown stops what is left of the agents (the survivors resign and
// stop; on the crashed ones this returns at once) and the watcher, and
// waits for every goroutine of the demo.
func (d *demo) shutdown() error {
	var errs []error
	var stopped []*demoAgent
	// The ShardSets first, all at once: one closing hands its shards to
	// the others, which are closing too.
	var sets sync.WaitGroup
	for _, a := range d.agents {
		if a.set != nil {
			sets.Go(func() { a.set.Close() })
		}
	}
	sets.Wait()
	for _, a := range d.agents {
		d.mu.Lock()
		_, gone := d.marks[a]
		d.mu.Unlock()
		if !gone && a.live != nil && len(stopped) == 0 {
			d.log.printf("demo", "--- shutting down: the survivors resign and stop")
		}
		if a.sem != nil {
			errs = append(errs, a.sem.Close())
		}
		if a.elect != nil {
			if a.elect.IsLeader() && !gone {
				d.log.printf(a.name, "resigns from %s", demoElection)
			}
			errs = append(errs, a.elect.Close())
		}
		if a.live != nil {
			ctx, cancel := context.WithTimeout(context.Background(), d.wait)
			errs = append(errs, a.live.Stop(ctx))
			cancel()
			if !gone {
				stopped = append(stopped, a)
			}
		}
	}
	if d.w != nil {
		// Let the watcher report the last Downs before it goes.
		deadline := time.After(time.Second)
	wait:
		for _, a := range stopped {
			select {
			case <-a.down:
			case <-deadline:
				break wait
			}
		}
		errs = append(errs, d.w.Close())
	}
	d.wg.Wait()
	return errors.Join(errs...)
}

// newUUID returns a random (version 4) UUID.
func newUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// demoLog prints the demo's lines, a timestamp and who speaks first.
type demoLog struct {
	mu sync.Mutex
	w  io.Writer
}

// raw prints line as it is.
func (l *demoLog) raw(line string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintln(l.w, line)
}

func (l *demoLog) printf(who, format string, args ...any) {
	l.lines([][2]string{{who, fmt.Sprintf(format, args...)}})
}

// lines prints lines, each who speaks and what it says, with no other
// line in between.
func (l *demoLog) lines(lines [][2]string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now().Format(timestamp)
	for _, line := range lines {
		fmt.Fprintf(l.w, "%s  %-8s %s\n", now, line[0], line[1])
	}
}

// semaphoreAct has agents share a Semaphore of Limit 2, as for host
// maintenance: the first two hold permits, the other two wait in line;
// the first holder crashes, and its permit ends before its slot goes to
// the first in line. Then the others release theirs.
func (d *demo) semaphoreAct(ctx context.Context, agents []*demoAgent) error {
	d.log.printf("demo", "--- Semaphore: %s, %s, %s and %s share %s, Limit 2: at most two hosts in maintenance at once",
		agents[0].name, agents[1].name, agents[2].name, agents[3].name, demoSemaphore)
	d.grants = make(chan demoGrant, len(agents))
	for _, a := range agents {
		if err := d.joinSemaphore(ctx, a); err != nil {
			return err
		}
	}
	var held []*coord.Permit
	for i, a := range agents {
		d.acquire(ctx, a)
		if err := d.waitKeys(ctx, demoSemaphore+"/", i+1); err != nil {
			return err
		}
		if i < 2 {
			g, err := d.grant(ctx, a)
			if err != nil {
				return err
			}
			what := ""
			if i == 0 {
				what = ": etcd's revision of its permit key, rising with each permit"
			}
			d.log.printf(a.name, "acquires a permit (fencing token %d%s), starts its maintenance", g.permit.Token(), what)
			held = append(held, g.permit)
			continue
		}
		d.log.printf(a.name, "asks for a permit; both are held: waits in line, %s", []string{"first", "second"}[i-2])
	}
	third, err := d.semaphoreCrash(ctx, agents[0], agents[2], held[0])
	if err != nil {
		return err
	}
	return d.semaphoreRelease(ctx, agents[1:], held[1], third)
}

// semaphoreCrash crashes holder, which held permit, and checks that its
// permit ends before next, first in line, is granted its slot. It
// returns next's permit.
func (d *demo) semaphoreCrash(ctx context.Context, holder, next *demoAgent, permit *coord.Permit) (*coord.Permit, error) {
	d.log.printf("demo", "--- %s, holding a permit, crashes: its client goes, its session is left to expire (TTL %v)", holder.name, d.ttl)
	d.crash(holder)
	if err := d.await(ctx, permit.Done(), holder.name+"'s permit ends"); err != nil {
		return nil, err
	}
	stepDown := d.since(holder)
	d.log.printf(holder.name, "permit ended %d ms after the crash (Done closed, Err: %v): its maintenance stops before its slot can go to another", stepDown, permit.Err())
	g, err := d.grant(ctx, next)
	if err != nil {
		return nil, err
	}
	handover := d.sinceAt(holder, g.at)
	if handover < stepDown {
		return nil, fmt.Errorf("%s was granted a permit %d ms after %s crashed, before its permit ended (%d ms)", next.name, handover, holder.name, stepDown)
	}
	if g.permit.Token() <= permit.Token() {
		return nil, fmt.Errorf("%s's fencing token %d, not above %s's %d", next.name, g.permit.Token(), holder.name, permit.Token())
	}
	d.log.printf(next.name, "acquires the freed permit (fencing token %d > %d) %d ms after %s crashed, once etcd expired its session",
		g.permit.Token(), permit.Token(), handover, holder.name)
	d.result(holder.name+" (holder) crash -> its permit ends (Done)", stepDown)
	d.result(holder.name+" (holder) crash -> "+next.name+" holds its permit", handover)
	return g.permit, nil
}

// semaphoreRelease has agents[0], which holds first, release it: the
// last agent, in line, is granted it; then every holder releases.
func (d *demo) semaphoreRelease(ctx context.Context, agents []*demoAgent, first, second *coord.Permit) error {
	holder, last := agents[0], agents[len(agents)-1]
	released := time.Now()
	if err := first.Release(ctx); err != nil {
		return fmt.Errorf("%s: %w", holder.name, err)
	}
	d.log.printf(holder.name, "ends its maintenance: releases its permit")
	g, err := d.grant(ctx, last)
	if err != nil {
		return err
	}
	d.log.printf(last.name, "acquires the released permit (fencing token %d) %d ms after the release", g.permit.Token(), g.at.Sub(released).Milliseconds())
	d.result(holder.name+" Release -> "+last.name+" holds its permit", g.at.Sub(released).Milliseconds())
	for _, p := range []struct {
		a *demoAgent
		p *coord.Permit
	}{{agents[1], second}, {last, g.permit}} {
		if err := p.p.Release(ctx); err != nil {
			return fmt.Errorf("%s: %w", p.a.name, err)
		}
	}
	holders, err := holder.sem.Holders(ctx)
	if err != nil {
		return err
	}
	d.log.printf("demo", "%s and %s release theirs: %d permits held", agents[1].name, last.name, len(holders))
	return nil
}

// joinSemaphore gives a its own client and its Semaphore.
func (d *demo) joinSemaphore(ctx context.Context, a *demoAgent) error {
	cli, err := d.etcd.dial()
	if err != nil {
		return err
	}
	a.cli = cli
	a.sem, err = coord.NewSemaphore(ctx, cli, coord.SemaphoreOptions{Key: demoSemaphore, Limit: 2, TTL: d.ttl, Identity: a.name})
	if err != nil {
		return fmt.Errorf("%s: %w", a.name, err)
	}
	return nil
}

// acquire runs a's Acquire in the background; its outcome goes to
// d.grants.
func (d *demo) acquire(ctx context.Context, a *demoAgent) {
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		p, err := a.sem.Acquire(ctx)
		d.grants <- demoGrant{a, p, err, time.Now()}
	}()
}

// grant waits for the outcome of an Acquire, which should be a's permit.
func (d *demo) grant(ctx context.Context, a *demoAgent) (demoGrant, error) {
	select {
	case g := <-d.grants:
		switch {
		case g.err != nil:
			return g, fmt.Errorf("%s: %w", g.agent.name, g.err)
		case g.agent != a:
			return g, fmt.Errorf("%s was granted a permit, %s was first in line", g.agent.name, a.name)
		}
		return g, nil
	case <-ctx.Done():
		return demoGrant{}, ctx.Err()
	case <-time.After(d.wait):
		return demoGrant{}, fmt.Errorf("%s: no permit within %v", a.name, d.wait)
	}
}
