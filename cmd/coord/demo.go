package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/go-coord/coord"
	"github.com/go-coord/coord/coordtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

const (
	// demoTTL is the TTL of the agents' leases and election sessions: the
	// time it takes etcd to notice a crash. The embedded etcd grants TTLs
	// down to 1 s; 2 s leaves room for a slow machine's renewals.
	demoTTL      = 2 * time.Second
	demoElection = "/coord/elections/scheduler"
	// demoWait bounds every wait of the demo: a step that takes longer is
	// a failure, not something to wait for.
	demoWait = 15 * time.Second
)

func cmdDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("demo", "", `Run a self-contained demo of coord, in about five seconds, with nothing to
set up: an embedded etcd, four simulated agents (each with its own client)
registering their hosts with a 2s lease, a watcher of the hosts, and an
election that three of them contest. Then one host crashes, then the leader
crashes, and the demo shows, as it happens, the Down events and the failover
with their measured delays; a third agent stops cleanly for comparison.
A crash is simulated by closing the agent's client without stopping
anything, so its leases are left to expire.`, false)
	if _, err := c.parse(args, stdout, 0); err != nil {
		return err
	}
	return runDemo(ctx, stdout)
}

// demoAgent is a simulated agent: a host with its own etcd client.
type demoAgent struct {
	name  string
	meta  coord.HostMetadata
	cli   *clientv3.Client
	live  *coord.HostLiveness
	elect *coord.Election // nil unless a candidate
	up    chan struct{}   // the watcher saw the host up
	down  chan struct{}   // the watcher saw the host down
}

// demoOutcome is the outcome of a Campaign run in the background.
type demoOutcome struct {
	agent *demoAgent
	err   error
	at    time.Time // when Campaign returned
}

type demo struct {
	log    *demoLog
	srv    *coordtest.Server
	agents []*demoAgent
	byUUID map[string]*demoAgent // fixed before the watcher starts
	cli    *clientv3.Client      // the watcher's, also used to look around
	w      *coord.HostWatcher
	leads  chan demoOutcome
	wg     sync.WaitGroup // the watcher's consumer and the campaigns

	mu      sync.Mutex
	marks   map[*demoAgent]demoMark // when and how an agent went
	results []demoResult            // the summary
}

func runDemo(ctx context.Context, stdout io.Writer) (err error) {
	start := time.Now()
	log := &demoLog{w: stdout}
	dir, err := os.MkdirTemp("", "coord-demo-")
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	defer os.RemoveAll(dir)
	log.printf("demo", "4 agents, a host watcher and an election on an embedded etcd; then crashes")
	log.printf("demo", "starting the embedded etcd")
	srv, err := coordtest.Start(dir, coordtest.Config{})
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	defer srv.Close()
	log.printf("demo", "etcd ready at %s", srv.Endpoint())

	d := &demo{log: log, srv: srv, byUUID: map[string]*demoAgent{}, marks: map[*demoAgent]demoMark{}}
	defer func() {
		if serr := d.shutdown(); err == nil {
			err = serr
		}
		if err == nil {
			log.printf("demo", "done in %.1fs", time.Since(start).Seconds())
		}
	}()
	if err := d.script(ctx); err != nil {
		if ctx.Err() != nil {
			return errors.New("demo interrupted")
		}
		return fmt.Errorf("demo: %w", err)
	}
	return nil
}

// script is the demo proper; shutdown cleans up after it, whatever
// happened.
func (d *demo) script(ctx context.Context) error {
	zones := []string{"eu-west-1a", "eu-west-1b"}
	for i := range 4 {
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
	n1, n2, n3, n4 := d.agents[0], d.agents[1], d.agents[2], d.agents[3]

	if err := d.startWatcher(ctx); err != nil {
		return err
	}
	for _, a := range d.agents {
		if err := d.register(ctx, a); err != nil {
			return err
		}
	}

	d.log.printf("demo", "%s, %s and %s campaign in election %s (session TTL %v)", n1.name, n2.name, n3.name, demoElection, demoTTL)
	d.leads = make(chan demoOutcome, len(d.agents))
	for _, a := range []*demoAgent{n1, n2, n3} {
		e, err := coord.NewElection(ctx, a.cli, coord.ElectionOptions{Key: demoElection, TTL: demoTTL, Identity: a.name})
		if err != nil {
			return fmt.Errorf("%s: %w", a.name, err)
		}
		a.elect = e
	}
	if err := n1.elect.Campaign(ctx, ""); err != nil {
		return fmt.Errorf("%s: %w", n1.name, err)
	}
	d.log.printf(n1.name, "leads %s (fencing token %d)", demoElection, n1.elect.Token())
	// One at a time, so that the queue, and the successor, are known.
	d.campaign(ctx, n2)
	if err := d.waitCandidates(ctx, 2); err != nil {
		return err
	}
	d.log.printf(n2.name, "campaigns; waits in line behind %s", n1.name)
	d.campaign(ctx, n3)
	if err := d.waitCandidates(ctx, 3); err != nil {
		return err
	}
	d.log.printf(n3.name, "campaigns; waits in line behind %s and %s", n1.name, n2.name)

	d.log.printf("demo", "--- %s crashes: its process dies, its lease is left to expire (TTL %v)", n4.name, n4.live.TTL())
	d.crash(n4)
	if err := d.await(ctx, n4.down, n4.name+" seen down"); err != nil {
		return err
	}
	d.result(n4.name+" crash -> Down seen by the watcher", d.since(n4))

	leaderToken := n1.elect.Token()
	d.log.printf("demo", "--- %s, the leader, crashes: its host lease and election session are left to expire", n1.name)
	d.crash(n1)
	downSeen, led := false, false
	timeout := time.After(demoWait)
	for !downSeen || !led {
		select {
		case <-n1.down:
			downSeen = true
			d.result(n1.name+" (leader) crash -> Down seen by the watcher", d.since(n1))
		case r := <-d.leads:
			if r.err != nil {
				return fmt.Errorf("%s: %w", r.agent.name, r.err)
			}
			if r.agent != n2 {
				return fmt.Errorf("%s leads, %s was next in line", r.agent.name, n2.name)
			}
			ms := d.sinceAt(n1, r.at)
			if ms < 0 {
				// n1 stepped down by itself before the crash: its
				// renewals were late (a machine too slow for the TTL).
				return fmt.Errorf("%s led before %s crashed: %s lost its leadership early", n2.name, n1.name, n1.name)
			}
			led = true
			d.log.printf(n2.name, "leads %s (fencing token %d > %d): %d ms after %s crashed", demoElection, n2.elect.Token(), leaderToken, ms, n1.name)
			d.result(n1.name+" (leader) crash -> "+n2.name+" leads", ms)
		case <-ctx.Done():
			return ctx.Err()
		case <-timeout:
			return fmt.Errorf("no failover from %s within %v", n1.name, demoWait)
		}
	}

	d.log.printf("demo", "--- %s stops cleanly: Stop revokes its lease, Close withdraws its candidacy", n3.name)
	d.mark(n3, "Stop")
	if err := n3.live.Stop(ctx); err != nil {
		return fmt.Errorf("%s: %w", n3.name, err)
	}
	if err := d.await(ctx, n3.down, n3.name+" seen down"); err != nil {
		return err
	}
	d.result(n3.name+" Stop -> Down seen by the watcher", d.since(n3))
	if err := n3.elect.Close(); err != nil {
		return fmt.Errorf("%s: %w", n3.name, err)
	}

	d.mu.Lock()
	lines := d.results
	d.mu.Unlock()
	d.log.printf("demo", "summary (lease and session TTL %v; etcd checks expiries every 500 ms):", demoTTL)
	width := 0
	for _, l := range lines {
		width = max(width, len(l.what))
	}
	for _, l := range lines {
		d.log.raw(fmt.Sprintf("%23s%-*s %5d ms", "", width, l.what, l.ms))
	}
	return nil
}

// startWatcher starts the host watcher, on its own client, and a consumer
// that prints its events.
func (d *demo) startWatcher(ctx context.Context) error {
	cli, err := d.srv.NewClientE()
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
	cli, err := d.srv.NewClientE()
	if err != nil {
		return err
	}
	a.cli = cli
	a.meta.StartedAt = time.Now().UnixNano()
	d.log.printf(a.name, "registers host %s (zone %s, lease TTL %v)", a.meta.HostUUID, a.meta.Labels["zone"], demoTTL)
	a.live, err = coord.RegisterHostLiveness(ctx, cli, a.meta, coord.LivenessOptions{TTL: demoTTL})
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
	ctx, cancel := context.WithTimeout(ctx, demoWait)
	defer cancel()
	for {
		resp, err := d.cli.Get(ctx, demoElection+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
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
	case <-time.After(demoWait):
		return fmt.Errorf("%s: not within %v", what, demoWait)
	}
}

// shutdown stops what is left of the agents (the survivors resign and
// stop; on the crashed ones this returns at once) and the watcher, and
// waits for every goroutine of the demo.
func (d *demo) shutdown() error {
	var errs []error
	var stopped []*demoAgent
	for _, a := range d.agents {
		d.mu.Lock()
		_, gone := d.marks[a]
		d.mu.Unlock()
		if !gone && a.live != nil && len(stopped) == 0 {
			d.log.printf("demo", "--- shutting down: the survivors resign and stop")
		}
		if a.elect != nil {
			if a.elect.IsLeader() && !gone {
				d.log.printf(a.name, "resigns from %s", demoElection)
			}
			errs = append(errs, a.elect.Close())
		}
		if a.live != nil {
			ctx, cancel := context.WithTimeout(context.Background(), demoWait)
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
	line := fmt.Sprintf(format, args...)
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(l.w, "%s  %-8s %s\n", time.Now().Format(timestamp), who, line)
}
