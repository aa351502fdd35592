package coord

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/go-coord/coord/coordtest"
)

// The model test drives a fleet of agents through random operations and
// faults chosen by a seeded generator, and checks after each quiet period
// that every watcher's replica is exactly etcd's set of hosts, that etcd's
// set of hosts is what the agents registered, that the election agrees
// with etcd, and that writes fenced with Guard form token-ordered runs.
// Links fail in several shapes (see mdShape); watchers have a small
// MaxBacklog and consumers that now and then stop reading, so that the
// catch-up of a consumer left behind is exercised. After the run, no two
// agents may have believed they led the same key at the same instant: the
// terms' intervals, from a campaign's return to the close of Done, must not
// intersect. Each fenced write also puts a register, mdFenced, that a
// checker client of its own reads at intervals and at the end; porcupine
// checks that the history of those writes and reads linearizes as a fenced
// register (see fence_history_test.go).
//
// Environment:
//
//	COORD_MODEL_SEED    replay a run (the seed is logged at the start and on failure)
//	COORD_MODEL_STEPS   number of operations (default mdDefaultSteps)
//	COORD_MODEL_BUDGET  time for the operations, e.g. 5m for a soak (default 75s; 15s with -short)
//	COORD_MODEL_TRACE   if set, log the operations and the library's records even on success
//
// A seed fixes the sequence of operations, their parameters and the pauses
// between them; what etcd and the library do meanwhile depends on timing, so
// a replay retraces a run without reproducing it to the millisecond.

const (
	mdPrefix    = "/model/hosts/"
	mdElection  = "/model/leader"
	mdCandidate = mdElection + "/"
	mdLog       = "/model/log/"
	mdFenced    = "/model/fenced"
	mdAgents    = 6
	mdTTL       = time.Second

	mdDefaultSteps  = 250
	mdDefaultBudget = 75 * time.Second
	// mdQuietEvery bounds the time between quiet periods, so that a slow
	// run still checks several.
	mdQuietEvery = 8 * time.Second
	// mdResetEvery is how often a link failing fast resets its
	// connections.
	mdResetEvery = 20 * time.Millisecond
	// mdCatchUpMsg is the watcher's record of a catch-up.
	mdCatchUpMsg = "coord: consumer behind, sending differences"
	// mdMinLags is how many lagging consumers a run must have had before
	// it must have reached a catch-up.
	mdMinLags = 4
)

func TestModel(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("random operations and faults keep replicas exact and fenced writes in token order", func(t *testing.T) {
		newModel(t, mdConfigFromEnv(t)).run()
	})
	t.Run("on a 3-member cluster, with some agents' watches on a member that lags", func(t *testing.T) {
		cfg := mdConfigFromEnv(t)
		cfg.cluster = true
		cfg.steps, cfg.budget = cfg.steps/2, cfg.budget/2
		newModel(t, cfg).run()
	})
}

type mdConfig struct {
	seed   uint64
	steps  int
	budget time.Duration
	// cluster runs the model on a 3-member cluster (see mdCluster), with
	// the lag-member step.
	cluster bool
}

func mdConfigFromEnv(t *testing.T) mdConfig {
	t.Helper()
	c := mdConfig{seed: uint64(time.Now().UnixNano()), steps: mdDefaultSteps, budget: mdDefaultBudget}
	if testing.Short() {
		c.budget = 15 * time.Second
	}
	if s := os.Getenv("COORD_MODEL_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("COORD_MODEL_SEED=%q: %v", s, err)
		}
		c.seed = n
	}
	if s := os.Getenv("COORD_MODEL_STEPS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("COORD_MODEL_STEPS=%q: want a positive integer", s)
		}
		c.steps = n
	}
	if s := os.Getenv("COORD_MODEL_BUDGET"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			t.Fatalf("COORD_MODEL_BUDGET=%q: want a positive duration", s)
		}
		c.budget = d
	}
	return c
}

// mdKind is a kind of operation of the generator.
type mdKind int

const (
	mdRegister mdKind = iota
	mdStop
	mdCrash
	mdUpdate
	mdCampaign
	mdTryCampaign
	mdResign
	mdCutAgent
	mdCutWatcher
	mdRestart
	mdCompact
	mdRewatch
	mdHandover
	mdCutLeader
	mdLag
	mdAcquire
	mdTryAcquire
	mdRelease
	mdCutHolder
	mdRangeDelete
	mdDeleteFault
	mdLagMember
	mdKinds
)

var mdKindNames = [mdKinds]string{"register", "stop", "crash", "update", "campaign", "try-campaign",
	"resign", "cut-agent", "cut-watcher", "restart-etcd", "compact", "rewatch", "handover", "cut-leader", "lag",
	"acquire", "try-acquire", "release", "cut-holder", "range-delete", "delete-fault", "lag-member"}

func (k mdKind) String() string { return mdKindNames[k] }

// mdWeights are the relative frequencies of the operations.
var mdWeights = [mdKinds]int{
	mdRegister: 14, mdStop: 5, mdCrash: 5, mdUpdate: 14, mdCampaign: 18, mdTryCampaign: 8,
	mdResign: 5, mdCutAgent: 7, mdCutWatcher: 5, mdRestart: 2, mdCompact: 4, mdRewatch: 2, mdHandover: 7, mdCutLeader: 4,
	mdLag: 5, mdAcquire: 10, mdTryAcquire: 5, mdRelease: 6, mdCutHolder: 4, mdRangeDelete: 2, mdDeleteFault: 4,
	mdLagMember: 5, // on a cluster only
}

// mdShape is a way a link fails.
type mdShape int

const (
	// mdSilent: a blackhole, silent from the start.
	mdSilent mdShape = iota
	// mdPartial fails fast, then goes silent: for a while every connection
	// is reset as soon as it is made (each try fails at once, as against a
	// rejecting firewall or a flapping interface), then the link drops
	// everything.
	mdPartial
	// mdSlow delivers every byte late by a delay around and beyond a
	// third of the TTL, each way: renewals are answered late or not in
	// time, while etcd still receives them.
	mdSlow
	// mdPaused holds the traffic and delivers it on heal: a partition that
	// heals before TCP gives up.
	mdPaused
	mdShapes
)

var mdShapeNames = [mdShapes]string{"blackhole", "partial", "slow", "pause"}

func (s mdShape) String() string { return mdShapeNames[s] }

// mdLink is how a link fails: its shape and the parameters of each shape,
// all drawn whatever the shape so that a seed's sequence does not depend on
// which cuts take effect.
type mdLink struct {
	shape   mdShape
	compact bool          // compact before a blackhole heals, so that what was missed must be resynced
	delay   time.Duration // of a slow link, each way
	burst   time.Duration // of the resets of a partial link
}

func (l mdLink) String() string {
	switch l.shape {
	case mdSlow:
		return fmt.Sprintf("slow, %v each way", l.delay.Round(time.Millisecond))
	case mdPartial:
		return fmt.Sprintf("partial, resets for %v then silent", l.burst.Round(time.Millisecond))
	}
	return l.shape.String()
}

// mdEtcd is the etcd of a model: a Server, or an mdCluster.
type mdEtcd interface {
	Client() *clientv3.Client
	NewClient(t testing.TB) *clientv3.Client
	// NewProxy returns a proxy for an agent's or a watcher's client.
	NewProxy(t testing.TB) *coordtest.Proxy
	// Stop and Restart stop and restart what the proxies lead to.
	Stop()
	Restart()
	Compact(ctx context.Context) int64
}

// mdCluster is a 3-member cluster as a model's etcd. The proxies, Client
// and NewClient lead to member 0; watcher w0 is an ordinary client of
// every member.
// The agents of odd index have their watches on member 2, lag, as
// clientv3 leaves a client's watches on the member it first reached
// while its other calls go elsewhere: the lag-member step isolates it
// for a while, so that those watches fall behind, then replay what
// they missed once it is healed; a restart of etcd restarts member 0 or
// (a step of two) lag, which then catches up.
type mdCluster struct {
	*coordtest.Cluster
	m0, lag *coordtest.Member
	m0Cli   *clientv3.Client // m0's only
	lagCli  *clientv3.Client // lag's only
}

func (c *mdCluster) NewProxy(t testing.TB) *coordtest.Proxy  { return c.m0.NewProxy(t) }
func (c *mdCluster) Client() *clientv3.Client                { return c.m0Cli }
func (c *mdCluster) NewClient(t testing.TB) *clientv3.Client { return c.m0.NewClient(t) }
func (c *mdCluster) Stop()                                   { c.m0.Stop() }
func (c *mdCluster) Restart()                                { c.m0.Restart() }

// model is the test's world: one etcd, the agents, the watchers, and what
// has been observed so far.
type model struct {
	t     *testing.T
	cfg   mdConfig
	srv   mdEtcd
	lag   *mdCluster       // srv on a cluster, else nil
	cli   *clientv3.Client // direct: etcd's truth
	rng   *rand.Rand       // the driver's operations and pauses; never shared
	qrng  *rand.Rand       // the driver's quiet periods, apart so that time-driven ones leave the operations as they are
	start time.Time
	ring  *mdRing

	hist    *fhHistory // of mdFenced
	checker *fhReader  // reads mdFenced into hist

	agents   []*mdAgent
	watchers []*mdWatcher

	stopping atomic.Bool // teardown has started: agents skip queued ops
	writes   atomic.Int64
	teardown sync.Once

	mu       sync.Mutex
	trace    []string
	counts   [mdKinds]int
	cuts     map[*coordtest.Proxy]*mdCut
	wins     map[int64]string // token -> identity that won it
	terms    []*mdTerm
	lagMu    sync.Mutex
	lagTimer *time.Timer // heals the lag member (see mdCluster) while it is isolated
	// deletes are the range deletes of candidates sent from outside.
	deletes []mdDelete
	quiets  int
	lags    int            // lagging consumers
	bg      sync.WaitGroup // term watchers

	sem mdSemState
}

// mdTerm is one leadership as seen from outside the library: from the
// return of a winning campaign to the close of Done, on the monotonic
// clock.
type mdTerm struct {
	agent, ident string
	key          string
	token        int64
	done         <-chan struct{}
	start, end   time.Time // end is zero while it lasts
}

// mdDelete is a range delete of candidate keys under prefix, sent from
// outside at sent and applied at revision rev.
type mdDelete struct {
	prefix string
	rev    int64
	sent   time.Time
}

// outsideEnd returns when a term, of a key under prefix created at token
// and believed held until end, ended as far as etcd is concerned: end,
// or the sending of an outside range delete that took its key, if that
// came first. A key created before such a delete and still standing when
// it was sent went with it, and its Guard fails from then on; its holder
// learns it only when the delete reaches its watch, so until then it
// still believes it holds, while a waiter may already have won: the
// checks of believed terms count it as ended at the delete (the fenced
// writes are checked whole).
func outsideEnd(deletes []mdDelete, prefix string, token int64, end time.Time) time.Time {
	for _, d := range deletes {
		if d.prefix == prefix && token < d.rev && d.sent.Before(end) {
			return d.sent
		}
	}
	return end
}

// takenByDeletes counts the terms and permits that an outside range
// delete ended (see outsideEnd).
func (m *model) takenByDeletes() (n int) {
	m.mu.Lock()
	deletes := m.deletes
	for _, t := range m.terms {
		if outsideEnd(deletes, mdCandidate, t.token, t.end) != t.end {
			n++
		}
	}
	m.mu.Unlock()
	m.sem.mu.Lock()
	defer m.sem.mu.Unlock()
	for _, t := range m.sem.terms {
		if outsideEnd(deletes, mdSem+"/", t.token, t.end) != t.end {
			n++
		}
	}
	return n
}

// mdCut is a proxy cut off until due.
type mdCut struct {
	link      mdLink
	what      string
	due       time.Time
	timer     *time.Timer // heals a pause or a slow link
	stopBurst func()      // ends the resets of a partial link and waits for them
}

func newModel(t *testing.T, cfg mdConfig) *model {
	m := &model{
		t: t, cfg: cfg, start: time.Now(),
		rng:  rand.New(rand.NewPCG(cfg.seed, 0x6d6f64656c)),
		qrng: rand.New(rand.NewPCG(cfg.seed, 0x7175696574)),
		ring: newMdRing(3000),
		hist: newFhHistory(),
		cuts: map[*coordtest.Proxy]*mdCut{},
		wins: map[int64]string{},
	}
	t.Logf("seed %d (replay with COORD_MODEL_SEED=%d), %d steps, budget %v", cfg.seed, cfg.seed, cfg.steps, cfg.budget)
	if cfg.cluster {
		c := coordtest.NewCluster(t, 3)
		ms := c.Members()
		m.lag = &mdCluster{Cluster: c, m0: ms[0], lag: ms[2], m0Cli: ms[0].NewClient(t), lagCli: ms[2].NewClient(t)}
		m.srv = m.lag
	} else {
		m.srv = coordtest.NewServer(t)
	}
	m.cli = m.srv.Client()
	m.checker = m.hist.readEvery(t, m.srv.NewClient(t), fhReadEvery, mdFenced)
	for i := range mdAgents {
		m.agents = append(m.agents, &mdAgent{
			m: m, i: i, id: fmt.Sprintf("agent-%d", i), px: m.srv.NewProxy(t),
			queue: make(chan mdOp, 1024), exited: make(chan struct{}),
		})
	}
	wpx := m.srv.NewProxy(t)
	// Watchers: a plain one, a slow consumer of a one-slot channel that
	// leaves agent-0 out as its Self, and one behind a proxy that gets cut.
	// Each has a small MaxBacklog (2 to 8, by the seed) and a small buffer,
	// so that a consumer that stops reading for a while is caught up.
	m.watchers = []*mdWatcher{
		{m: m, name: "w0", cli: m.srv.NewClient(t), buffer: 4},
		{m: m, name: "w1", cli: m.srv.NewClient(t), self: "agent-0", buffer: 1, slow: true},
		{m: m, name: "w2", cli: wpx.NewClient(t), px: wpx, buffer: 2},
	}
	if m.lag != nil {
		m.watchers[0].cli = m.lag.Cluster.NewClient(t)
	}
	for _, w := range m.watchers {
		w.backlog = 2 + m.rng.IntN(7)
	}
	// After the proxies: runs before their cleanups, which close the
	// agents' clients under them.
	t.Cleanup(m.shutdown)
	t.Cleanup(func() {
		if t.Failed() || os.Getenv("COORD_MODEL_TRACE") != "" {
			m.dump()
		}
		if t.Failed() {
			t.Logf("FAILED with seed %d: replay with COORD_MODEL_SEED=%d", cfg.seed, cfg.seed)
		}
	})
	for j, w := range m.watchers {
		w.start(uint64(j))
	}
	for _, a := range m.agents {
		go a.loop()
	}
	return m
}

func (m *model) run() {
	deadline := m.start.Add(m.cfg.budget)
	for _, a := range m.agents {
		m.dispatch(a, "register", func(a *mdAgent) string { return a.register() })
	}
	m.quiet("initial")
	lastQuiet := time.Now()
	nextQuiet := 10 + m.qrng.IntN(20)
	step := 0
	for ; step < m.cfg.steps && time.Now().Before(deadline); step++ {
		m.heal(false, true)
		m.step(step)
		time.Sleep(time.Duration(m.rng.Int64N(int64(150 * time.Millisecond))))
		if nextQuiet--; nextQuiet == 0 || time.Since(lastQuiet) > mdQuietEvery {
			m.quiet(fmt.Sprintf("after step %d", step))
			lastQuiet, nextQuiet = time.Now(), 10+m.qrng.IntN(20)
		}
	}
	m.quiet("final")
	m.shutdown()
	if err := m.checker.finish(); err != nil {
		m.fatalf("final read of %s: %v", mdFenced, err)
	}
	writes, tokens := m.checkLog()
	if int64(writes) < m.writes.Load() {
		m.fatalf("%d writes in the log, but %d guarded writes succeeded", writes, m.writes.Load())
	}
	overlaps, longest := m.checkTerms()
	semRevs, semOver, semWrites, semTokens := m.checkSemaphore()
	m.hist.check(m.t, m.cfg.seed)
	m.mu.Lock()
	var ops []string
	for k, n := range m.counts {
		ops = append(ops, fmt.Sprintf("%v=%d", mdKind(k), n))
	}
	terms, lags := len(m.terms), m.lags
	m.mu.Unlock()
	var events, catchUps []string
	caughtUp := int64(0)
	for _, w := range m.watchers {
		events = append(events, fmt.Sprintf("%s=%d", w.name, w.total))
		catchUps = append(catchUps, fmt.Sprintf("%s=%d (MaxBacklog %d, Buffer %d, %d resync signals)",
			w.name, w.catchUps.Load(), w.backlog, w.buffer, w.resyncs.Load()))
		caughtUp += w.catchUps.Load()
	}
	m.t.Logf("seed %d: %d of %d steps in %v (budget %v), %d quiet periods checked",
		m.cfg.seed, step, m.cfg.steps, time.Since(m.start).Round(time.Millisecond), m.cfg.budget, m.quiets)
	m.t.Logf("ops: %s", strings.Join(ops, " "))
	m.t.Logf("leadership: %d terms, %d fenced writes under %d tokens (%d attempted writes succeeded), longest overlap %v",
		terms, writes, tokens, m.writes.Load(), longest)
	m.t.Logf("overlaps: %d; terms and permits ended by an outside range delete: %d", overlaps, m.takenByDeletes())
	m.ring.mu.Lock()
	m.t.Logf("resumed after a step-down: %v", m.ring.resumed)
	m.ring.mu.Unlock()
	m.sem.mu.Lock()
	permits, attempted := len(m.sem.terms), m.sem.writes
	m.sem.mu.Unlock()
	if semWrites < attempted {
		m.errorf("%d writes in the semaphore log, but %d guarded writes succeeded", semWrites, attempted)
	}
	m.t.Logf("semaphore (limit %d): %d permits, %d fenced writes under %d tokens (%d attempted writes succeeded); revisions in more than %d permits' write intervals: %d; time more than %d permits were believed held: %v",
		mdSemLimit, permits, semWrites, semTokens, attempted, mdSemLimit, semRevs, mdSemLimit, time.Duration(semOver))
	if semRevs != 0 || semOver != 0 {
		m.errorf("more than %d permits at once: %d revisions in more than %d permits' fenced-write intervals; believed held by more than %d for %v",
			mdSemLimit, semRevs, mdSemLimit, mdSemLimit, time.Duration(semOver))
	}
	m.t.Logf("events consumed: %s", strings.Join(events, " "))
	m.t.Logf("catch-ups: %d over %d lagging consumers: %s", caughtUp, lags, strings.Join(catchUps, ", "))
	if overlaps != 0 {
		m.errorf("%d pairs of terms of different agents overlap: two agents believed they led at the same instant", overlaps)
	}
	if caughtUp == 0 && lags >= mdMinLags {
		m.errorf("no consumer was caught up over %d lagging consumers: the catch-up path was not reached", lags)
	}
}

// step picks and performs one operation.
func (m *model) step(step int) {
	weights := mdWeights
	if m.lag == nil {
		weights[mdLagMember] = 0
	}
	total := 0
	for _, w := range weights {
		total += w
	}
	n := m.rng.IntN(total)
	k := mdKind(0)
	for ; n >= weights[k]; k++ {
		n -= weights[k]
	}
	a := m.agents[m.rng.IntN(len(m.agents))]
	m.count(k)
	switch k {
	case mdRegister:
		m.dispatch(a, "register", func(a *mdAgent) string { return a.register() })
	case mdStop:
		// Both halves, or only one of them.
		what := m.rng.IntN(3)
		m.dispatch(a, []string{"stop all", "stop liveness", "close election"}[what],
			func(a *mdAgent) string { return a.stop(what != 2, what != 1) })
	case mdCrash:
		m.dispatch(a, "crash", func(a *mdAgent) string { return a.crash() })
	case mdUpdate:
		zone := []string{"a", "b", "c"}[m.rng.IntN(3)]
		m.dispatch(a, "update zone="+zone, func(a *mdAgent) string { return a.update(zone) })
	case mdCampaign, mdTryCampaign:
		d := 200*time.Millisecond + time.Duration(m.rng.Int64N(int64(1800*time.Millisecond)))
		try := k == mdTryCampaign
		m.dispatch(a, fmt.Sprintf("%v within %v", k, d.Round(time.Millisecond)),
			func(a *mdAgent) string { return a.campaign(d, try) })
	case mdResign:
		m.dispatch(a, "resign", func(a *mdAgent) string { return a.resign() })
	case mdHandover:
		// Whoever leads resigns; the others' campaigns under way take over.
		for _, a := range m.agents {
			m.dispatch(a, "resign (handover)", func(a *mdAgent) string { return a.resign() })
		}
	case mdCutAgent:
		d := 500*time.Millisecond + time.Duration(m.rng.Int64N(int64(time.Second)))
		m.cut(a.px, a.id, d, m.link())
	case mdCutLeader:
		// Cut whoever believes it leads for longer than the TTL while three
		// others campaign: the old leader must step down before any of
		// them can win. Or, half the time, for less than the TTL while it
		// campaigns again too: it may then resume, same token, if its
		// lease lived on.
		d := mdTTL + time.Duration(m.rng.Int64N(int64(1500*time.Millisecond)))
		short := m.rng.IntN(2) == 0
		if short {
			d = mdTTL/2 + time.Duration(m.rng.Int64N(int64(mdTTL*2/5)))
		}
		l := m.link()
		others := m.rng.Perm(len(m.agents))
		wait := mdTTL + time.Duration(m.rng.Int64N(int64(2*time.Second)))
		for _, ag := range m.agents {
			if e := ag.shared.Load(); e != nil && e.IsLeader() {
				m.cut(ag.px, ag.id+" (leader)", d, l)
				if short {
					m.dispatch(ag, fmt.Sprintf("campaign again once stepped down, within %v", wait.Round(time.Millisecond)),
						func(a *mdAgent) string { return a.campaignAgain(wait) })
				}
				break
			}
		}
		for _, i := range others[:3] {
			m.dispatch(m.agents[i], fmt.Sprintf("campaign within %v", wait.Round(time.Millisecond)),
				func(a *mdAgent) string { return a.campaign(wait, false) })
		}
	case mdCutWatcher:
		d := 500*time.Millisecond + time.Duration(m.rng.Int64N(int64(time.Second)))
		w := m.watchers[2]
		m.cut(w.px, w.name, d, m.link())
	case mdLag:
		// A consumer stops reading while an agent it watches publishes a
		// burst of updates, more than its channel, its MaxBacklog and
		// twice the hosts it may know of, so that it falls behind past
		// MaxBacklog; it reads on a while after the burst. An agent that
		// is not registered registers first.
		w := m.watchers[m.rng.IntN(len(m.watchers))]
		others := slices.DeleteFunc(slices.Clone(m.agents), func(o *mdAgent) bool { return o.id == w.self })
		a = others[m.rng.IntN(len(others))]
		n := w.buffer + w.backlog + 2*mdAgents + 2 + m.rng.IntN(12)
		hold := 200*time.Millisecond + time.Duration(m.rng.Int64N(int64(time.Second)))
		m.dispatch(a, fmt.Sprintf("burst of %d updates while %s lags", n, w.name),
			func(a *mdAgent) string { return a.burst(w, n, hold) })
	case mdRestart:
		began := time.Now()
		if m.lag != nil && m.rng.IntN(2) == 0 {
			m.tracef("restart the lag member")
			m.lag.lag.Restart()
			m.tracef("lag member restarted (%v)", time.Since(began).Round(time.Millisecond))
			return
		}
		m.tracef("restart etcd")
		m.srv.Restart()
		m.tracef("etcd restarted (%v)", time.Since(began).Round(time.Millisecond))
	case mdCompact:
		ctx, cancel := context.WithTimeout(context.Background(), patience())
		rev := m.srv.Compact(ctx)
		cancel()
		m.tracef("compacted at %d", rev)
	case mdAcquire, mdTryAcquire, mdRelease, mdCutHolder:
		m.semStep(k, a)
	case mdRangeDelete:
		// An operator's reset: del --prefix of the election's or the
		// semaphore's candidates, in one revision, leader and waiters
		// at once. The terms it takes are counted as ended when it was
		// sent (see outsideEnd).
		// An attempt that failed (during a raft election, say) may still
		// have been applied: the first one counts as when it was sent.
		prefix := []string{mdCandidate, mdSem + "/"}[m.rng.IntN(2)]
		ctx, cancel := context.WithTimeout(context.Background(), patience())
		sent := time.Now()
		resp, err := m.cli.Delete(ctx, prefix, clientv3.WithPrefix())
		for err != nil && ctx.Err() == nil {
			m.tracef("range delete of %s: %v; again", prefix, err)
			resp, err = m.cli.Delete(ctx, prefix, clientv3.WithPrefix())
		}
		cancel()
		if err != nil {
			m.fatalf("range delete of %s: %v", prefix, err)
		}
		m.mu.Lock()
		m.deletes = append(m.deletes, mdDelete{prefix: prefix, rev: resp.Header.Revision, sent: sent})
		m.mu.Unlock()
		m.tracef("deleted %d keys under %s at revision %d", resp.Deleted, prefix, resp.Header.Revision)
	case mdDeleteFault:
		// The agent's next delete, or all of them for a while, meet "no
		// leader", as during an etcd leader change; a resign follows.
		n, d := 1, time.Duration(0)
		if m.rng.IntN(2) == 0 {
			n, d = 0, 200*time.Millisecond+time.Duration(m.rng.Int64N(int64(1300*time.Millisecond)))
		}
		a.faults.set(n, d)
		m.tracef("%s: deletes fail: next %d, for %v", a.id, n, d.Round(time.Millisecond))
		m.dispatch(a, "resign (deletes failing)", func(a *mdAgent) string { return a.resign() })
	case mdLagMember:
		// The member the odd agents watch on is cut off from its peers
		// for a while: until it sees it has no leader, it serves their
		// watches from where it was; once healed, it replays what it
		// missed (the shape of two leaders at once in trust round 4).
		d := 300*time.Millisecond + time.Duration(m.rng.Int64N(int64(2200*time.Millisecond)))
		m.lagMu.Lock()
		defer m.lagMu.Unlock()
		if m.lagTimer != nil {
			m.tracef("lag member already isolated")
			return
		}
		m.lag.lag.Isolate()
		m.lagTimer = time.AfterFunc(d, m.healLag)
		m.tracef("lag member isolated for %v", d.Round(time.Millisecond))
		// Meanwhile whoever leads resigns and campaigns again at once,
		// on its session: the same key name, a new term; the odd agents,
		// their watches on the lag member, then campaign behind it, and
		// the lag member replays the delete of the first term once
		// healed.
		wait := d + time.Second + time.Duration(m.rng.Int64N(int64(time.Second)))
		var leader *mdAgent
		var term int64
		key := ""
		for _, ag := range m.agents {
			if e := ag.shared.Load(); e != nil && e.IsLeader() {
				leader, term = ag, e.Token()
				key = m.termKey(term)
				m.dispatch(ag, "resign and campaign again", func(a *mdAgent) string {
					return a.resign() + "; " + a.campaign(wait, false)
				})
			}
		}
		for _, ag := range m.agents {
			if ag.i%2 == 1 && ag != leader {
				m.dispatch(ag, fmt.Sprintf("campaign within %v, behind the leader's new term", wait.Round(time.Millisecond)),
					func(a *mdAgent) string { return m.behind(key, term, wait) + a.campaign(wait, false) })
			}
		}
	case mdRewatch:
		j := m.rng.IntN(len(m.watchers))
		m.tracef("rewatch %s", m.watchers[j].name)
		m.watchers[j].stop()
		m.watchers[j].start(uint64(step))
	}
}

func (m *model) count(k mdKind) {
	m.mu.Lock()
	m.counts[k]++
	m.mu.Unlock()
}

// dispatch queues op on agent a; a performs its operations in order.
func (m *model) dispatch(a *mdAgent, desc string, op func(*mdAgent) string) {
	m.tracef("%s: queue %s", a.id, desc)
	a.queue <- mdOp{desc: desc, fn: op}
}

// link draws how a link fails.
func (m *model) link() mdLink {
	return mdLink{
		shape:   mdShape(m.rng.IntN(int(mdShapes))),
		compact: m.rng.IntN(2) == 0,
		// Each way, around and beyond a third of the TTL: a round trip
		// takes from 3/4 of a renewal's timeout (TTL/3) to 4 times it.
		delay: mdTTL/8 + time.Duration(m.rng.Int64N(int64(13*mdTTL/24))),
		burst: mdTTL/10 + time.Duration(m.rng.Int64N(int64(2*mdTTL/5))),
	}
}

// cut makes px fail as l says for d.
//
// A pause holds the traffic and delivers it on Unpause: a partition that
// heals before TCP gives up. A slow link delays every byte. Both heal on a
// timer. A blackhole drops the traffic: the proxy loses bytes of live
// connections, which TCP never does, and leaves them unusable (every new
// stream is reset with PROTOCOL_ERROR once the HPACK tables of the two ends
// disagree), so a blackhole heals as a partition that outlasted TCP: the
// connections are reset (by restarting etcd while still cut) before traffic
// flows again. A partial link is a blackhole whose connections are reset
// every mdResetEvery for its burst: the etcd client's tries fail at once
// until the burst ends, then hang. Blackholes and partial links heal at the
// driver's next step after d (Restart must run on the test's goroutine).
func (m *model) cut(px *coordtest.Proxy, what string, d time.Duration, l mdLink) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cuts[px] != nil {
		return
	}
	c := &mdCut{link: l, what: what, due: time.Now().Add(d)}
	switch l.shape {
	case mdPaused:
		px.Pause()
		c.timer = time.AfterFunc(d, func() { m.healTimed(px, c) })
	case mdSlow:
		px.Delay(l.delay)
		c.timer = time.AfterFunc(d, func() { m.healTimed(px, c) })
	case mdSilent:
		px.Blackhole()
	case mdPartial:
		px.Blackhole()
		c.stopBurst = mdResets(px, l.burst)
	}
	m.cuts[px] = c
	m.traceLocked("cut %s off (%v) for %v", what, l, d.Round(time.Millisecond))
}

// mdResets resets the connections through the blackholed px every
// mdResetEvery for burst, and returns a function that ends the resets and
// waits for them.
func mdResets(px *coordtest.Proxy, burst time.Duration) func() {
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(mdResetEvery)
		defer tick.Stop()
		end := time.NewTimer(burst)
		defer end.Stop()
		for {
			select {
			case <-tick.C:
				// Unblackhole resets the connections it cut; the link is
				// still down, so it is cut again at once.
				px.Unblackhole()
				px.Blackhole()
			case <-end.C:
				return
			case <-stop:
				return
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() { close(stop) })
		<-done
	}
}

// termKey returns the candidate key of term, if it is there.
func (m *model) termKey(term int64) string {
	ctx, cancel := context.WithTimeout(context.Background(), patience())
	defer cancel()
	resp, err := m.cli.Get(ctx, mdCandidate, clientv3.WithPrefix())
	if err != nil {
		m.fatalf("read the candidates: %v", err)
	}
	for _, kv := range resp.Kvs {
		if kv.CreateRevision == term {
			return string(kv.Key)
		}
	}
	return ""
}

// behind waits, within d, until key (if any) is there again for a term
// after term, so that a campaign then queues behind it, and says if it
// did not.
func (m *model) behind(key string, term int64, d time.Duration) string {
	if key == "" {
		return ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for {
		resp, err := m.cli.Get(ctx, key)
		if err == nil && len(resp.Kvs) == 1 && resp.Kvs[0].CreateRevision > term {
			return ""
		}
		if !sleep(ctx, 10*time.Millisecond) {
			return fmt.Sprintf("%s not there again after term %d; ", key, term)
		}
	}
}

// healLag heals the lag member (see mdCluster) if it is isolated.
func (m *model) healLag() {
	m.lagMu.Lock()
	defer m.lagMu.Unlock()
	if m.lagTimer == nil {
		return
	}
	m.lagTimer.Stop()
	m.lagTimer = nil
	m.lag.lag.Heal()
	m.tracef("lag member healed")
}

// healTimed ends the pause or the slow link c of px, unless it is over.
func (m *model) healTimed(px *coordtest.Proxy, c *mdCut) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cuts[px] != c {
		return
	}
	delete(m.cuts, px)
	if c.link.shape == mdPaused {
		px.Unpause()
	} else {
		px.Delay(0)
	}
	m.traceLocked("heal %s (%v)", c.what, c.link.shape)
}

// heal ends the cuts due by now, or all of them. With restart, it resets
// the connections of the blackholes it ends by restarting etcd; without, it
// only lets their traffic through (at teardown, when their clients close).
func (m *model) heal(all, restart bool) {
	m.mu.Lock()
	timed := map[*coordtest.Proxy]*mdCut{}
	var holes []*coordtest.Proxy
	var bursts []func()
	compact := false
	for px, c := range m.cuts {
		switch {
		case !all && time.Now().Before(c.due):
		case c.timer != nil:
			timed[px] = c
		default:
			holes = append(holes, px)
			compact = compact || c.link.compact
			if c.stopBurst != nil {
				bursts = append(bursts, c.stopBurst)
			}
		}
	}
	m.mu.Unlock()
	for px, c := range timed {
		c.timer.Stop()
		m.healTimed(px, c)
	}
	for _, stop := range bursts {
		stop()
	}
	if len(holes) == 0 {
		return
	}
	began := time.Now()
	if restart {
		if compact {
			ctx, cancel := context.WithTimeout(context.Background(), patience())
			m.tracef("compacted at %d before healing", m.srv.Compact(ctx))
			cancel()
		}
		m.srv.Stop()
	}
	m.mu.Lock()
	for _, px := range holes {
		m.traceLocked("heal %s (unblackhole)", m.cuts[px].what)
		delete(m.cuts, px)
		px.Unblackhole()
	}
	m.mu.Unlock()
	if restart {
		m.srv.Restart()
		m.tracef("etcd restarted to reset the blackholed connections (%v)", time.Since(began).Round(time.Millisecond))
	}
}

// quiet heals every cut, lets every agent finish its operations, waits until
// the system has converged, and checks it.
func (m *model) quiet(label string) {
	m.t.Helper()
	m.heal(true, true)
	m.healLag()
	m.tracef("quiet period %s", label)
	for _, a := range m.agents {
		b := make(chan struct{})
		a.queue <- mdOp{barrier: b}
		select {
		case <-b:
		case <-time.After(patience()):
			m.fatalf("quiet period %s: %s still busy with %q after %v", label, a.id, a.current.Load(), patience())
		}
	}
	for _, w := range m.watchers {
		w.unlag()
	}
	// Leases of crashed agents and of cut-off registrations need TTL plus
	// etcd's expiry slack; heals back off up to a couple of seconds.
	deadline := time.Now().Add(patience())
	var diffs []string
	for {
		diffs = m.converged()
		if len(diffs) == 0 {
			break
		}
		if time.Now().After(deadline) {
			m.fatalf("quiet period %s: not converged after %v:\n\t%s", label, patience(), strings.Join(diffs, "\n\t"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	m.checkLog()
	m.mu.Lock()
	m.quiets++
	m.mu.Unlock()
	m.tracef("quiet period %s: converged", label)
}

// converged compares the agents' registrations with etcd's hosts, every
// watcher's replica and view with those, and the election's leader with
// who believes it leads. It returns the differences.
func (m *model) converged() []string {
	var diffs []string
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second*scale)
	defer cancel()
	resp, err := m.cli.Get(ctx, mdPrefix, clientv3.WithPrefix())
	if err != nil {
		return []string{fmt.Sprintf("get hosts: %v", err)}
	}
	truth := map[string]HostMetadata{}
	for _, kv := range resp.Kvs {
		if h, ok := mdDecode(kv.Key, kv.Value); ok {
			truth[h.HostUUID] = h
		}
	}

	// What the agents registered: the last metadata confirmed, or one of
	// the updates since whose outcome is unknown.
	for _, a := range m.agents {
		got, there := truth[a.id]
		if a.live == nil {
			if there {
				diffs = append(diffs, fmt.Sprintf("etcd has %s, which is not registered: %s", a.id, mdMeta(got)))
			}
			continue
		}
		select {
		case <-a.live.Done():
			m.fatalf("registration of %s ended by itself: %v", a.id, a.live.Err())
		default:
		}
		if !there {
			diffs = append(diffs, fmt.Sprintf("etcd lacks %s, registered with %s", a.id, mdMeta(a.metas...)))
		} else if !slices.ContainsFunc(a.metas, func(h HostMetadata) bool { return reflect.DeepEqual(h, got) }) {
			diffs = append(diffs, fmt.Sprintf("etcd has %s, want one of %s", mdMeta(got), mdMeta(a.metas...)))
		}
	}

	for _, w := range m.watchers {
		want := maps.Clone(truth)
		delete(want, w.self)
		if d := mdDiff(w.name+" replica", w.replicaCopy(), want); d != "" {
			diffs = append(diffs, d)
		}
		view := map[string]HostMetadata{}
		for _, h := range w.w.Hosts() {
			view[h.HostUUID] = h
		}
		if d := mdDiff(w.name+" Hosts()", view, want); d != "" {
			diffs = append(diffs, d)
		}
		if !isClosed(w.w.Synced()) {
			diffs = append(diffs, w.name+": Synced still open")
		}
	}

	// The election: who believes it leads, and the first candidate in etcd.
	var believers []*mdAgent
	for _, a := range m.agents {
		if a.elec != nil && a.elec.IsLeader() {
			believers = append(believers, a)
		}
	}
	cands, err := m.cli.Get(ctx, mdCandidate, clientv3.WithFirstCreate()...)
	if err != nil {
		return append(diffs, fmt.Sprintf("get leader: %v", err))
	}
	switch {
	case len(believers) > 1:
		var who []string
		for _, a := range believers {
			who = append(who, fmt.Sprintf("%s (token %d)", a.ident, a.elec.Token()))
		}
		diffs = append(diffs, "several believe they lead: "+strings.Join(who, ", "))
	case len(believers) == 1:
		a := believers[0]
		if len(cands.Kvs) == 0 {
			diffs = append(diffs, fmt.Sprintf("%s believes it leads with token %d; no candidate in etcd", a.ident, a.elec.Token()))
			break
		}
		kv := cands.Kvs[0]
		if kv.CreateRevision != a.elec.Token() || string(kv.Value) != a.ident {
			diffs = append(diffs, fmt.Sprintf("%s believes it leads with token %d; etcd's leader is %q created at %d",
				a.ident, a.elec.Token(), kv.Value, kv.CreateRevision))
			break
		}
		if got, err := a.elec.Leader(ctx); err != nil || got != a.ident {
			diffs = append(diffs, fmt.Sprintf("%s leads but its Leader() = %q, %v", a.ident, got, err))
		}
	case len(cands.Kvs) > 0:
		kv := cands.Kvs[0]
		diffs = append(diffs, fmt.Sprintf("nobody believes it leads; etcd's first candidate is %q (%s) created at %d",
			kv.Value, kv.Key, kv.CreateRevision))
	}
	return append(diffs, m.semConverged(ctx)...)
}

// checkLog reads the fenced writes in revision order and checks that their
// tokens never decrease (so no two terms' writes interleave) and that each
// token belongs to one identity. It returns the number of writes and tokens.
func (m *model) checkLog() (writes, tokens int) {
	m.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience())
	defer cancel()
	resp, err := m.cli.Get(ctx, mdLog, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByModRevision, clientv3.SortAscend))
	if err != nil {
		m.fatalf("read the log: %v", err)
	}
	var last int64
	owner := map[int64]string{}
	for _, kv := range resp.Kvs {
		ident, tok, ok := strings.Cut(string(kv.Value), " ")
		token, err := strconv.ParseInt(tok, 10, 64)
		if !ok || err != nil {
			m.fatalf("log entry %s = %q", kv.Key, kv.Value)
		}
		if token < last {
			m.fatalf("log entry %s = %q at revision %d: token %d after token %d (writes of two terms interleave)",
				kv.Key, kv.Value, kv.ModRevision, token, last)
		}
		if o, seen := owner[token]; seen && o != ident {
			m.fatalf("token %d used by %s and %s", token, o, ident)
		}
		if token >= kv.ModRevision {
			m.fatalf("log entry %s = %q written at revision %d, not after its token", kv.Key, kv.Value, kv.ModRevision)
		}
		owner[token] = ident
		last = token
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for token, ident := range owner {
		if w, ok := m.wins[token]; ok && w != ident {
			m.fatalf("token %d won by %s, used in the log by %s", token, w, ident)
		}
	}
	return len(resp.Kvs), len(owner)
}

// checkTerms counts, after shutdown, the pairs of terms of different agents
// on one key whose intervals intersect: two agents that believed they led
// at the same instant. It returns the count and the longest overlap.
func (m *model) checkTerms() (overlaps int, longest time.Duration) {
	m.t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	terms := slices.Clone(m.terms)
	slices.SortFunc(terms, func(a, b *mdTerm) int { return a.start.Compare(b.start) })
	at := func(t time.Time) time.Duration { return t.Sub(m.start).Round(time.Millisecond) }
	for i, a := range terms {
		if a.end.IsZero() {
			m.t.Errorf("seed %d: term %d of %s never ended", m.cfg.seed, a.token, a.ident)
			continue
		}
		for _, b := range terms[i+1:] {
			if !b.start.Before(a.end) {
				break
			}
			if b.key != a.key {
				continue
			}
			if b.token <= a.token {
				m.t.Errorf("seed %d: term %d of %s began after term %d of %s", m.cfg.seed, b.token, b.ident, a.token, a.ident)
			}
			if b.agent == a.agent {
				continue
			}
			end := outsideEnd(m.deletes, mdCandidate, a.token, a.end)
			if !b.start.Before(end) {
				continue // a's key went with an outside delete first
			}
			if !b.end.IsZero() && b.end.Before(end) {
				end = b.end
			}
			overlaps++
			longest = max(longest, end.Sub(b.start))
			m.t.Errorf("seed %d: overlap on %s: %s (token %d, +%v to +%v) and %s (token %d, +%v to +%v) both believed they led for %v",
				m.cfg.seed, a.key, a.ident, a.token, at(a.start), at(a.end), b.ident, b.token, at(b.start), at(b.end), end.Sub(b.start))
		}
	}
	return overlaps, longest
}

// won records a term that a campaign of a has just won.
//
// Its start is taken once the other terms have been looked at: a term whose
// Done is found closed ended before this one began, however late its
// watching goroutine runs, so that a handover is not taken for an overlap;
// a term whose Done is still open overlaps this one.
func (m *model) won(a *mdAgent, e *Election) {
	token, done := e.Token(), e.Done()
	if token == 0 {
		return // already over
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var over []*mdTerm
	for _, t := range m.terms {
		if t.end.IsZero() && isClosed(t.done) {
			over = append(over, t)
		}
	}
	start := time.Now()
	for _, t := range over {
		t.end = start
	}
	if w, ok := m.wins[token]; ok {
		if w != a.ident {
			m.t.Errorf("seed %d: token %d won by %s and by %s", m.cfg.seed, token, w, a.ident)
		}
		return // a campaign while leading
	}
	m.wins[token] = a.ident
	term := &mdTerm{agent: a.id, ident: a.ident, key: mdElection, token: token, done: done, start: start}
	m.terms = append(m.terms, term)
	m.bg.Add(1)
	go func() {
		defer m.bg.Done()
		<-done
		end := time.Now()
		m.mu.Lock()
		if term.end.IsZero() || end.Before(term.end) {
			term.end = end
		}
		m.mu.Unlock()
	}()
}

// shutdown stops everything the model started; it runs once, at the end of
// run or from a cleanup after a failure.
func (m *model) shutdown() {
	m.teardown.Do(func() {
		m.heal(true, false)
		m.healLag()
		m.stopping.Store(true)
		for _, a := range m.agents {
			close(a.queue)
		}
		for _, a := range m.agents {
			select {
			case <-a.exited:
			case <-time.After(patience()):
				m.t.Errorf("%s did not shut down: busy with %q", a.id, a.current.Load())
			}
		}
		for _, w := range m.watchers {
			w.stop()
		}
		ended := make(chan struct{})
		go func() {
			m.bg.Wait()
			close(ended)
		}()
		select {
		case <-ended:
		case <-time.After(patience()):
			m.t.Errorf("seed %d: a leadership's Done still open after its election closed", m.cfg.seed)
		}
		m.shutdownSemaphore()
	})
}

func (m *model) tracef(format string, args ...any) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.traceLocked(format, args...)
}

func (m *model) traceLocked(format string, args ...any) {
	m.trace = append(m.trace, fmt.Sprintf("%9.3fs %s", time.Since(m.start).Seconds(), fmt.Sprintf(format, args...)))
}

// fatalf fails the test from the test's goroutine.
func (m *model) fatalf(format string, args ...any) {
	m.t.Helper()
	m.t.Fatalf("seed %d: "+format, append([]any{m.cfg.seed}, args...)...)
}

// errorf fails the test from any goroutine.
func (m *model) errorf(format string, args ...any) {
	m.t.Helper()
	m.tracef("ERROR: "+format, args...)
	m.t.Errorf("seed %d: "+format, append([]any{m.cfg.seed}, args...)...)
}

// dump logs the operations and the library's latest records.
func (m *model) dump() {
	m.mu.Lock()
	trace := slices.Clone(m.trace)
	m.mu.Unlock()
	keep := 400
	if os.Getenv("COORD_MODEL_TRACE") != "" {
		keep = len(trace)
	}
	if len(trace) > keep {
		m.t.Logf("operations: (%d earlier left out)", len(trace)-keep)
		trace = trace[len(trace)-keep:]
	} else {
		m.t.Logf("operations:")
	}
	for _, l := range trace {
		m.t.Log("  " + l)
	}
	lines := m.ring.lines()
	m.t.Logf("library log, last %d records:", len(lines))
	for _, l := range lines {
		m.t.Log("  " + l)
	}
}

func (m *model) logger(attrs ...any) *slog.Logger {
	return slog.New(&mdHandler{ring: m.ring, start: m.start}).With(attrs...)
}

// mdOp is an operation queued on an agent, or a barrier.
type mdOp struct {
	desc    string
	fn      func(*mdAgent) string // returns the outcome, for the trace
	barrier chan struct{}
}

// mdAgent is one agent process: a client through its own proxy, a
// registration and an election. Its state is owned by its loop goroutine;
// the driver reads it only while the agent is idle at a barrier.
type mdAgent struct {
	m       *model
	i       int
	id      string
	px      *coordtest.Proxy
	queue   chan mdOp
	exited  chan struct{}
	current atomic.Value // the description of the operation under way

	cli     *clientv3.Client
	clients []*clientv3.Client // every client it opened, closed at the end
	live    *HostLiveness
	metas   []HostMetadata // the metadata confirmed last, then updates of unknown outcome
	gen     int            // metadata generations
	regs    int            // registrations
	elec    *Election
	shared  atomic.Pointer[Election] // elec, for the driver to read at any time
	ident   string
	inc     int // elections joined
	writer  *mdWriter
	sem     *Semaphore
	permits []*mdPermit  // held, or ended with their writers not yet done
	holding atomic.Int32 // len(permits), for the driver to read at any time
	faults  deleteFaults // what its clients' deletes meet
}

func (a *mdAgent) loop() {
	defer close(a.exited)
	for op := range a.queue {
		if op.barrier != nil {
			close(op.barrier)
			continue
		}
		if a.m.stopping.Load() {
			continue
		}
		a.current.Store(op.desc)
		began := time.Now()
		out := op.fn(a)
		a.m.tracef("%s: %s -> %s (%v)", a.id, op.desc, out, time.Since(began).Round(time.Millisecond))
		a.current.Store("")
	}
	a.current.Store("shutdown")
	a.stop(true, true)
	for _, c := range a.clients {
		c.Close()
	}
}

func (a *mdAgent) opCtx(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), d*scale)
}

func (a *mdAgent) register() string {
	if a.cli == nil {
		cfg := a.px.ClientConfig()
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithChainUnaryInterceptor(a.faults.intercept))
		cli, err := clientv3.New(cfg)
		if err != nil {
			a.m.errorf("%s: new client: %v", a.id, err)
			return "no client"
		}
		if a.m.lag != nil && a.i%2 == 1 {
			cli.Watcher = clientv3.NewWatcher(a.m.lag.lagCli) // see mdCluster
		}
		a.cli = cli
		a.clients = append(a.clients, cli)
	}
	var out []string
	if a.live == nil {
		a.gen++
		a.regs++
		meta := a.meta("a")
		// Long enough to wait out the lease of a crashed predecessor.
		ctx, cancel := a.opCtx(5 * time.Second)
		h, err := RegisterHostLiveness(ctx, a.cli, meta, LivenessOptions{
			Prefix: mdPrefix, TTL: mdTTL, Logger: a.m.logger(),
		})
		cancel()
		if err != nil {
			out = append(out, fmt.Sprintf("register: %v", err))
		} else {
			a.live, a.metas = h, []HostMetadata{meta}
			out = append(out, fmt.Sprintf("registered %x", int64(h.LeaseID())))
		}
	}
	if a.elec == nil {
		ident := fmt.Sprintf("%s#%d", a.id, a.inc+1)
		ctx, cancel := a.opCtx(2 * time.Second)
		e, err := NewElection(ctx, a.cli, ElectionOptions{
			Key: mdElection, TTL: mdTTL, Identity: ident, Logger: a.m.logger("elector", ident),
		})
		cancel()
		if err != nil {
			out = append(out, fmt.Sprintf("join election: %v", err))
		} else {
			a.inc++
			a.elec, a.ident = e, ident
			a.shared.Store(e)
			a.writer = a.startWriter()
			out = append(out, "joined as "+ident)
		}
	}
	if a.elec != nil {
		if s := a.joinSemaphore(); s != "" {
			out = append(out, s)
		}
	}
	if len(out) == 0 {
		return "already running"
	}
	return strings.Join(out, "; ")
}

// meta returns the agent's metadata of the current generation.
func (a *mdAgent) meta(zone string) HostMetadata {
	return HostMetadata{
		HostUUID: a.id, Hostname: "host-" + a.id, Version: fmt.Sprintf("1.%d", a.gen),
		StartedAt: int64(a.regs), Labels: map[string]string{"zone": zone, "gen": strconv.Itoa(a.gen)},
	}
}

// stop ends the registration and/or leaves the election, gracefully.
func (a *mdAgent) stop(liveness, election bool) string {
	var out []string
	if election && a.elec != nil {
		a.leaveSemaphore()
		a.writer.stop()
		a.elec.Close()
		out = append(out, "left "+a.ident)
		a.elec, a.writer = nil, nil
		a.shared.Store(nil)
	}
	if liveness && a.live != nil {
		ctx, cancel := a.opCtx(2 * time.Second)
		err := a.live.Stop(ctx)
		cancel()
		out = append(out, fmt.Sprintf("stopped: %v", err))
		a.live = nil
	}
	if len(out) == 0 {
		return "nothing to stop"
	}
	return strings.Join(out, "; ")
}

// crash closes the agent's client under its registration and election, as
// if the process died, then checks that both end by themselves.
func (a *mdAgent) crash() string {
	if a.cli == nil {
		return "not running"
	}
	a.cli.Close()
	a.cli = nil
	var out []string
	if a.live != nil {
		select {
		case <-a.live.Done():
			if err := a.live.Err(); !errors.Is(err, ErrClientClosed) {
				a.m.errorf("%s: registration ended with %v after its client closed, want ErrClientClosed", a.id, err)
			}
		case <-time.After(patience()):
			a.m.errorf("%s: registration still running %v after its client closed", a.id, patience())
		}
		ctx, cancel := a.opCtx(2 * time.Second)
		if err := a.live.Stop(ctx); err != nil {
			a.m.errorf("%s: Stop after the client closed: %v", a.id, err)
		}
		cancel()
		a.live = nil
		out = append(out, "registration ended")
	}
	for _, mp := range a.permits {
		select {
		case <-mp.p.Done():
		case <-time.After(patience()):
			a.m.errorf("%s: permit %d still held %v after its client closed", a.ident, mp.p.Token(), patience())
		}
	}
	a.leaveSemaphore()
	if a.elec != nil {
		select {
		case <-a.elec.Done():
		case <-time.After(patience()):
			a.m.errorf("%s: leadership still running %v after its client closed", a.ident, patience())
		}
		a.writer.stop()
		a.elec.Close()
		a.elec, a.writer = nil, nil
		a.shared.Store(nil)
		out = append(out, "election ended")
	}
	return strings.Join(append([]string{"crashed"}, out...), "; ")
}

func (a *mdAgent) update(zone string) string {
	if a.live == nil {
		return "not registered"
	}
	a.gen++
	meta := a.meta(zone)
	ctx, cancel := a.opCtx(2 * time.Second)
	err := a.live.Update(ctx, meta)
	cancel()
	if err != nil {
		// It may have landed, or not.
		a.metas = append(a.metas, meta)
		return fmt.Sprintf("update to %s: %v", meta.Version, err)
	}
	a.metas = []HostMetadata{meta}
	return "updated to " + meta.Version
}

// burst publishes n updates in a row, registering first if need be, while
// the consumer of w stops reading, until hold after the burst. Once the
// consumer's channel is full it registers again, under a new lease: a
// catch-up then owes the consumer a Down and an Up of this host.
func (a *mdAgent) burst(w *mdWatcher, n int, hold time.Duration) string {
	var out string
	if a.live == nil {
		if out = a.register() + "; "; a.live == nil {
			return out + "no burst"
		}
	}
	if !w.lag() {
		return out + w.name + " lags already"
	}
	a.m.mu.Lock()
	a.m.lags++
	a.m.mu.Unlock()
	done := 0
	for i := range n {
		if i == w.buffer+1 {
			out += a.stop(true, false) + "; " + a.register() + "; "
		}
		if res := a.update([]string{"a", "b", "c"}[i%3]); strings.HasPrefix(res, "updated") {
			done++
		}
	}
	w.unlagIn(hold)
	return out + fmt.Sprintf("%d of %d updates done, now at %s; %s reads on in %v",
		done, n, a.metas[len(a.metas)-1].Version, w.name, hold.Round(time.Millisecond))
}

func (a *mdAgent) campaign(d time.Duration, try bool) string {
	if a.elec == nil {
		return "not in the election"
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var err error
	won := false
	if try {
		won, err = a.elec.TryCampaign(ctx, "")
	} else {
		err = a.elec.Campaign(ctx, "")
		won = err == nil
	}
	if won {
		a.m.won(a, a.elec)
		return fmt.Sprintf("leads with token %d", a.elec.Token())
	}
	if err != nil {
		return fmt.Sprintf("lost: %v", err)
	}
	return "someone else leads"
}

// campaignAgain waits until our leadership ends (a step-down), within d,
// then campaigns within d.
func (a *mdAgent) campaignAgain(d time.Duration) string {
	if a.elec == nil {
		return "not in the election"
	}
	select {
	case <-a.elec.Done():
	case <-time.After(d):
		return "leads on"
	}
	return a.campaign(d, false)
}

func (a *mdAgent) resign() string {
	if a.elec == nil {
		return "not in the election"
	}
	token := a.elec.Token()
	ctx, cancel := a.opCtx(2 * time.Second)
	err := a.elec.Resign(ctx)
	cancel()
	if err != nil {
		return fmt.Sprintf("resign token %d: %v", token, err)
	}
	return fmt.Sprintf("resigned token %d", token)
}

// mdWriter appends to the log under Guard while its election leads, and
// puts mdFenced in the same Txn.
type mdWriter struct {
	cancel context.CancelFunc
	done   chan struct{}
}

func (a *mdAgent) startWriter() *mdWriter {
	ctx, cancel := context.WithCancel(context.Background())
	w := &mdWriter{cancel: cancel, done: make(chan struct{})}
	cli, e, ident, inc := a.cli, a.elec, a.ident, a.inc
	client := a.m.hist.client()
	r := rand.New(rand.NewPCG(a.m.cfg.seed, uint64(a.i)<<32|uint64(inc)))
	go func() {
		defer close(w.done)
		n := 0
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(10*time.Millisecond + time.Duration(r.Int64N(int64(40*time.Millisecond)))):
			}
			// Token and Guard from one term: tokens of successive terms
			// differ, so equal tokens around Guard mean the same term.
			token := e.Token()
			if token == 0 {
				continue
			}
			guard := e.Guard()
			if e.Token() != token {
				continue
			}
			n++
			key := fmt.Sprintf("%s%s/%d/%06d", mdLog, a.id, inc, n)
			value := fmt.Sprintf("%s %d #%d", ident, token, n)
			wctx, wcancel := context.WithTimeout(ctx, 500*time.Millisecond)
			resp, err := a.m.hist.write(client, mdFenced, ident, token, value, func() (*clientv3.TxnResponse, error) {
				return cli.Txn(wctx).If(guard).
					Then(clientv3.OpPut(key, fmt.Sprintf("%s %d", ident, token)),
						clientv3.OpGet(mdCandidate, clientv3.WithFirstCreate()...),
						clientv3.OpPut(mdFenced, value)).Commit()
			})
			wcancel()
			if err != nil || !resp.Succeeded {
				continue
			}
			a.m.writes.Add(1)
			kvs := resp.Responses[1].GetResponseRange().Kvs
			if len(kvs) == 0 || kvs[0].CreateRevision != token {
				a.m.errorf("%s wrote under Guard with token %d at revision %d, but the leader then was %v",
					ident, token, resp.Header.Revision, kvs)
			}
		}
	}()
	return w
}

func (w *mdWriter) stop() {
	if w == nil {
		return
	}
	w.cancel()
	<-w.done
}

// mdWatcher consumes a HostWatcher's events into a replica, checking each
// event against it.
type mdWatcher struct {
	m       *model
	name    string
	cli     *clientv3.Client
	px      *coordtest.Proxy // nil unless behind a proxy
	self    string
	buffer  int
	backlog int // MaxBacklog
	slow    bool

	w     *HostWatcher
	done  chan struct{} // closed when the consumer exits
	total int           // events consumed by earlier watchers; read after stop

	catchUps atomic.Int64 // consumers caught up, by every watcher started
	resyncs  atomic.Int64 // SignalWatcherResync signals, likewise

	mu      sync.Mutex
	replica map[string]HostMetadata
	closing bool
	count   int
	hold    chan struct{} // while the consumer lags: closed when it reads on
	unhold  *time.Timer
}

func (w *mdWatcher) start(salt uint64) {
	log := slog.New(mdCounter{Handler: w.m.logger("watcher", w.name).Handler(), msg: mdCatchUpMsg, n: &w.catchUps})
	hw, err := NewHostWatcher(context.Background(), w.cli, WatcherOptions{
		Prefix: mdPrefix, Self: w.self, Buffer: w.buffer, MaxBacklog: w.backlog, Logger: log,
		OnSignal: func(s Signal) {
			if s.Kind == SignalWatcherResync {
				w.resyncs.Add(1)
			}
		},
	})
	if err != nil {
		w.m.fatalf("%s: NewHostWatcher: %v", w.name, err)
	}
	w.mu.Lock()
	w.w, w.replica, w.closing, w.count = hw, map[string]HostMetadata{}, false, 0
	w.mu.Unlock()
	w.done = make(chan struct{})
	r := rand.New(rand.NewPCG(w.m.cfg.seed, salt<<8|uint64(len(w.name))))
	go w.consume(hw, r)
}

func (w *mdWatcher) consume(hw *HostWatcher, r *rand.Rand) {
	defer close(w.done)
	var last int64
	for {
		w.mu.Lock()
		hold := w.hold
		w.mu.Unlock()
		if hold != nil {
			<-hold
		}
		ev, ok := <-hw.Events()
		if !ok {
			break
		}
		if w.slow {
			time.Sleep(time.Duration(r.Int64N(int64(2 * time.Millisecond))))
		}
		if ev.Revision < last {
			w.m.errorf("%s: %v %s at revision %d after revision %d", w.name, ev.Kind, ev.HostUUID, ev.Revision, last)
		}
		last = ev.Revision
		if ev.HostUUID == w.self || ev.HostUUID != ev.Metadata.HostUUID {
			w.m.errorf("%s: event %+v (Self %q)", w.name, ev, w.self)
		}
		w.mu.Lock()
		w.count++
		old, had := w.replica[ev.HostUUID]
		switch ev.Kind {
		case HostUp:
			if had {
				w.m.errorf("%s: Up of %s at %d (synthetic %v), already up with %s", w.name, ev.HostUUID, ev.Revision, ev.Synthetic, mdMeta(old))
			}
			w.replica[ev.HostUUID] = ev.Metadata
		case HostUpdated:
			if !had {
				w.m.errorf("%s: Updated of %s at %d (synthetic %v), which is not up", w.name, ev.HostUUID, ev.Revision, ev.Synthetic)
			}
			w.replica[ev.HostUUID] = ev.Metadata
		case HostDown:
			if !had {
				w.m.errorf("%s: Down of %s at %d (synthetic %v), which is not up", w.name, ev.HostUUID, ev.Revision, ev.Synthetic)
			} else if !reflect.DeepEqual(old, ev.Metadata) {
				w.m.errorf("%s: Down of %s carries %s, last seen %s", w.name, ev.HostUUID, mdMeta(ev.Metadata), mdMeta(old))
			}
			delete(w.replica, ev.HostUUID)
		default:
			w.m.errorf("%s: event of kind %v", w.name, ev.Kind)
		}
		w.mu.Unlock()
	}
	w.mu.Lock()
	closing := w.closing
	w.mu.Unlock()
	if !closing {
		w.m.errorf("%s: Events closed: %v", w.name, hw.Err())
	}
}

// lag makes the consumer stop reading before its next event, unless it
// lags already, and reports whether it did.
func (w *mdWatcher) lag() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.hold != nil {
		return false
	}
	w.hold = make(chan struct{})
	return true
}

// unlagIn lets the consumer read on after d, if it lags.
func (w *mdWatcher) unlagIn(d time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.hold != nil && w.unhold == nil {
		w.unhold = time.AfterFunc(d, w.unlag)
	}
}

// unlag lets the consumer read on.
func (w *mdWatcher) unlag() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.hold == nil {
		return
	}
	if w.unhold != nil {
		w.unhold.Stop()
		w.unhold = nil
	}
	close(w.hold)
	w.hold = nil
}

func (w *mdWatcher) stop() {
	if w.w == nil {
		return
	}
	w.unlag()
	w.mu.Lock()
	w.closing = true
	w.mu.Unlock()
	w.w.Close()
	<-w.done
	if err := w.w.Err(); err != nil {
		w.m.errorf("%s: Err after Close: %v", w.name, err)
	}
	w.total += w.count
	w.count = 0
}

func (w *mdWatcher) replicaCopy() map[string]HostMetadata {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.replica)
}

// mdDecode reads a host as a watcher does: JSON of HostMetadata naming the
// host of its key.
func mdDecode(key, value []byte) (HostMetadata, bool) {
	var h HostMetadata
	id := strings.TrimPrefix(string(key), mdPrefix)
	if err := json.Unmarshal(value, &h); err != nil || id == "" || strings.Contains(id, "/") || h.HostUUID != id {
		return HostMetadata{}, false
	}
	return h, true
}

// mdDiff describes how got differs from want, "" if it does not.
func mdDiff(what string, got, want map[string]HostMetadata) string {
	var d []string
	for _, id := range slices.Sorted(maps.Keys(want)) {
		g, ok := got[id]
		switch {
		case !ok:
			d = append(d, "lacks "+mdMeta(want[id]))
		case !reflect.DeepEqual(g, want[id]):
			d = append(d, fmt.Sprintf("has %s, etcd %s", mdMeta(g), mdMeta(want[id])))
		}
	}
	for _, id := range slices.Sorted(maps.Keys(got)) {
		if _, ok := want[id]; !ok {
			d = append(d, "has extra "+mdMeta(got[id]))
		}
	}
	if len(d) == 0 {
		return ""
	}
	return what + ": " + strings.Join(d, ", ")
}

// mdMeta is a short form of metadata for messages.
func mdMeta(ms ...HostMetadata) string {
	var s []string
	for _, h := range ms {
		s = append(s, fmt.Sprintf("%s{%s %s #%d}", h.HostUUID, h.Version, h.Labels["zone"], h.StartedAt))
	}
	return strings.Join(s, "|")
}

// mdRing keeps the latest log records of the library, for a failure's
// report.
type mdRing struct {
	mu   sync.Mutex
	buf  []string
	next int
	full bool
	// resumed counts the terms taken back after a step-down, by the
	// record that says so.
	resumed map[string]int
}

func newMdRing(n int) *mdRing { return &mdRing{buf: make([]string, n), resumed: map[string]int{}} }

func (r *mdRing) add(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.buf[r.next] = s
	r.next = (r.next + 1) % len(r.buf)
	r.full = r.full || r.next == 0
}

func (r *mdRing) lines() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.full {
		return slices.Clone(r.buf[:r.next])
	}
	return append(slices.Clone(r.buf[r.next:]), r.buf[:r.next]...)
}

// mdCounter is a slog.Handler that counts the records carrying msg and
// hands every record on.
type mdCounter struct {
	slog.Handler
	msg string
	n   *atomic.Int64
}

func (c mdCounter) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == c.msg {
		c.n.Add(1)
	}
	return c.Handler.Handle(ctx, r)
}

func (c mdCounter) WithAttrs(as []slog.Attr) slog.Handler {
	return mdCounter{Handler: c.Handler.WithAttrs(as), msg: c.msg, n: c.n}
}

func (c mdCounter) WithGroup(name string) slog.Handler {
	return mdCounter{Handler: c.Handler.WithGroup(name), msg: c.msg, n: c.n}
}

// mdHandler is a slog.Handler writing one line per record into a ring.
type mdHandler struct {
	ring  *mdRing
	start time.Time
	attrs string
}

func (h *mdHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h *mdHandler) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%9.3fs %-5s %s%s", r.Time.Sub(h.start).Seconds(), r.Level, r.Message, h.attrs)
	r.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
		return true
	})
	h.ring.add(b.String())
	if r.Message == "coord: leadership resumed" || r.Message == "coord: permit resumed" {
		h.ring.mu.Lock()
		h.ring.resumed[strings.TrimPrefix(r.Message, "coord: ")]++
		h.ring.mu.Unlock()
	}
	return nil
}

func (h *mdHandler) WithAttrs(as []slog.Attr) slog.Handler {
	var b strings.Builder
	b.WriteString(h.attrs)
	for _, a := range as {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
	}
	return &mdHandler{ring: h.ring, start: h.start, attrs: b.String()}
}

func (h *mdHandler) WithGroup(string) slog.Handler { return h }
