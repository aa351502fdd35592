package coord

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-coord/coord/coordtest"
)

// TestShardModel runs seeded random joins, crashes, graceful leaves,
// drains, takeovers of a registration, bystander hosts, cut-off and slow
// links and etcd restarts under ShardSets of random weights and zones
// whose Runs write under their Guards. After each step every shard is
// owned again, within the TTL and a slack, by the member that ranks first
// for it among the live members, and by no other set. At the end it
// checks etcd's history of the writes: in each shard, tokens never go
// back, a token is one host's, and no bystander ever wrote. A checker
// client of its own reads the shards' work at intervals and at the end,
// and porcupine checks that the writes and reads of each shard linearize
// as a fenced register (see fence_history_test.go). The seed is logged;
// COORD_MODEL_SEED replays a run; a failure prints every record the shard
// sets logged, at Debug, with the steps among them.
func TestShardModel(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("COORD_MODEL_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("COORD_MODEL_SEED=%q: %v", s, err)
		}
		seed = n
	}
	// Bounded: each step lasts up to three TTLs and its check up to a few
	// more, which emulated CPUs stretch tenfold.
	steps := 10
	if testing.Short() || scale > 1 {
		steps = 4
	}
	t.Logf("seed %d (replay with COORD_MODEL_SEED=%d), %d steps", seed, seed, steps)
	// TTL at least 3 s: under the race detector, beside the package's
	// other parallel tests, a loaded machine left renewal tries of a sixth
	// of 2 s unanswered for seconds; every member's session ended, again
	// and again, and no step could settle within its window.
	m := &shModel{t: t, rng: rand.New(rand.NewPCG(seed, 0x7368617264)), l: newShLedger(), shards: shNames(12),
		ttl: max(3*time.Second, 2*time.Second*scale), bystanders: map[string]bool{}}
	m.l.hist = newFhHistory()
	tap, log := newLogTap()
	tap.dumpOnFailure(t)
	m.log = log
	m.srv, _ = newEtcd(t)
	var work []string
	for _, s := range m.shards {
		work = append(work, shWork+s)
	}
	checker := m.l.hist.readEvery(t, m.srv.NewClient(t), fhReadEvery, work...)
	for range 3 {
		m.join()
	}
	m.bystander()
	m.faultEnd = time.Now()
	m.settle("the start")
	for i := range steps {
		op := m.step()
		m.log.Info("model: step", "n", i+1, "op", op)
		took := m.settle(fmt.Sprintf("step %d (%s)", i+1, op))
		t.Logf("step %d: %s (%d members live, %d bystanders; settled %v after the fault)", i+1, op, len(m.live), len(m.bystanders), took.Round(time.Millisecond))
	}
	m.heal()
	m.faultEnd = time.Now()
	m.settle("the end")
	m.noBystanderCandidate()
	for _, h := range m.all {
		h.set.Close()
	}
	if err := checker.finish(); err != nil {
		t.Fatalf("final read of the shards' work: %v; replay with COORD_MODEL_SEED=%d", err, seed)
	}
	ws := shHistory(t, m.srv.Client())
	overlaps, handoffs := shCheck(ws)
	t.Logf("overlaps: %d (%d fenced writes applied, %d answered, %d handoffs; %d sessions ended by unanswered renewals; seed %d)",
		overlaps, len(ws), len(m.l.acked()), handoffs, tap.count("coord: lease renewals unanswered"), seed)
	m.l.hist.check(t, seed)
	if overlaps != 0 {
		t.Fatalf("%d overlapping writes; replay with COORD_MODEL_SEED=%d", overlaps, seed)
	}
	m.noBystanderWrite(ws)
}

// shModel is the state of TestShardModel: the members, live or gone, and
// the bystanders.
type shModel struct {
	t          *testing.T
	rng        *rand.Rand
	log        *slog.Logger // the shard sets' (each With its host) and the steps'
	l          *shLedger
	srv        *coordtest.Server
	shards     []string
	ttl        time.Duration             // the shard sets' TTL
	all        []*shMember               // every member ever started, live or gone
	live       []*shMember               // the live members
	bystanders map[string]bool           // the HostUUIDs of the live bystanders
	bys        []*shHost                 // the live bystanders
	slow       map[*shHost]time.Duration // links delayed (each way) until the next heal
	n          int
	faultEnd   time.Time // when the last step's fault was over
}

// shMember is a member of TestShardModel: a host running a ShardSet on
// its own registration (Host), as the others rank it.
type shMember struct {
	*shHost
	label string      // who its Runs' writes say they are: HostUUID, and the process after a takeover
	rank  ShardMember // what it announces
}

// step draws and applies one operation, then lets the fleet run for a
// moment of random length, and names it. A fault (a cut, a lag) is over
// when step returns. A slow link lasts until the next heal: slow, but not
// so slow that its leases cannot be kept (a renewal is tried for a sixth
// of the TTL, and its answer takes two delays), nor that its client can
// connect no more once a cut or a restart resets its connection (the
// server's preface must come within coordtest.ClientConnectTimeout: a
// slow link of 960 ms under a TTL of 20 s, then a cut, left a member cut
// off for good), so that the check after each step holds with it; a lag
// is slower, for a while.
func (m *shModel) step() string {
	var op string
	switch r := m.rng.IntN(16); {
	case len(m.live) <= 2 || r < 2:
		op = "join " + m.join()
	case r < 4:
		op = "crash " + m.crash()
	case r < 5:
		op = "leave " + m.leave()
	case r < 7:
		op = "drain " + m.drain()
	case r < 9:
		op = "take over " + m.takeover()
	case r < 10:
		op = m.bystanderStep()
	case r < 12:
		op = "cut " + m.cut(time.Duration(m.rng.Int64N(int64(2*m.ttl))))
	case r < 13:
		op = "lag " + m.lag(time.Duration(m.rng.Int64N(int64(m.ttl/2))), time.Duration(m.rng.Int64N(int64(m.ttl))))
	case r < 15:
		op = "slow " + m.delay(time.Duration(m.rng.Int64N(int64(min(m.ttl/16, coordtest.ClientConnectTimeout/4)))))
	default:
		op = "restart etcd"
		m.srv.Restart()
	}
	m.faultEnd = time.Now()
	<-time.After(time.Duration(m.rng.Int64N(int64(m.ttl))))
	return op
}

// join starts a new member: a host registered through a link of its own
// (see host), its shard set on that registration, of a random weight and
// zone.
func (m *shModel) join() string {
	h := m.host(m.nextID(), LivenessOptions{})
	mb := m.start(h, h.id)
	return fmt.Sprintf("%s (weight %v, zone %s)", h.id, mb.rank.Weight, mb.rank.Zone)
}

// host registers id, with the shard sets' TTL (so that a slow link slows
// both alike), on a client of its own, through a proxy of its own.
func (m *shModel) host(id string, opts LivenessOptions) *shHost {
	h := &shHost{id: id, px: m.srv.NewProxy(m.t)}
	h.cli = h.px.NewClient(m.t)
	opts.TTL = m.ttl
	h.live = register(m.t, h.cli, id, opts)
	return h
}

// nextID returns a HostUUID not used yet, members and bystanders drawn
// from the same sequence, so that bystanders rank among the members.
func (m *shModel) nextID() string {
	m.n++
	return fmt.Sprintf("host-%02d", m.n-1)
}

// start starts h's shard set on h.live, of a random weight and zone, its
// Runs writing as label, and adds it to the live members.
func (m *shModel) start(h *shHost, label string) *shMember {
	mb := &shMember{shHost: h, label: label,
		rank: ShardMember{HostUUID: h.id, Weight: float64(1 + m.rng.IntN(2)), Zone: []string{"a", "b"}[m.rng.IntN(2)]}}
	opts := ShardOptions{Shards: m.shards, Host: h.live, Weight: mb.rank.Weight, Zone: mb.rank.Zone,
		TTL: m.ttl, Run: m.l.writer(h.cli, label), Logger: m.log.With("host", label)}
	h.start(m.t, m.l, opts)
	m.all = append(m.all, mb)
	m.live = append(m.live, mb)
	return mb
}

// pick removes a random live member from the live ones and returns it.
func (m *shModel) pick() *shMember {
	i := m.rng.IntN(len(m.live))
	h := m.live[i]
	m.live = slices.Delete(m.live, i, i+1)
	return h
}

func (m *shModel) crash() string {
	h := m.pick()
	h.crash()
	return h.label
}

// leave closes a member's shard set, then stops its registration.
func (m *shModel) leave() string {
	h := m.pick()
	h.set.Close()
	return h.label + m.stop(h.shHost)
}

// drain drains a member, then closes its shard set and stops its
// registration: it owns nothing once Drain returns, there being other
// members to take its shards, and the shards settle on the others while
// its shard set still runs, draining.
func (m *shModel) drain() string {
	h := m.pick()
	began := time.Now()
	if err := h.set.Drain(testCtx(m.t)); err != nil {
		m.t.Fatalf("drain %s: %v", h.label, err)
	}
	took := time.Since(began)
	if owned := h.set.Owned(); len(owned) != 0 {
		m.t.Fatalf("%s drained, still owning %v", h.label, owned)
	}
	m.faultEnd = time.Now()
	m.settle("the drain of " + h.label + ", before its Close")
	h.set.Close()
	return fmt.Sprintf("%s (drained in %v)%s", h.label, took.Round(time.Millisecond), m.stop(h.shHost))
}

// stop stops h's registration, and says how if not plainly.
func (m *shModel) stop(h *shHost) string {
	err := h.live.Stop(testCtx(m.t))
	// A revoke is bounded by the TTL; over a slow link, when the
	// connection is made again after an etcd restart, Stop may say that
	// the revoke timed out, and the lease expires by itself, which the
	// model allows.
	if err != nil && m.slow[h] > 0 && errors.Is(err, context.DeadlineExceeded) {
		return " (its revoke timed out on the slow link)"
	}
	if err != nil {
		m.t.Fatal(err)
	}
	return ""
}

// takeover starts another process of a live member: on a link and client
// of its own, it registers the same HostUUID with Takeover and starts its
// own shard set on that registration. The old shard set must end with
// ErrHostGone, owning nothing.
func (m *shModel) takeover() string {
	old := m.pick()
	began := time.Now()
	h := m.host(old.id, LivenessOptions{Takeover: true})
	gen := 1
	if _, g, ok := strings.Cut(old.label, "."); ok {
		gen, _ = strconv.Atoi(g)
		gen++
	}
	mb := m.start(h, fmt.Sprintf("%s.%d", h.id, gen))
	select {
	case <-old.set.Done():
	case <-time.After(patience()):
		m.t.Fatalf("%s taken over: its old shard set has not ended", old.id)
	}
	if err := old.set.Err(); !errors.Is(err, ErrHostGone) {
		m.t.Fatalf("%s taken over: its old shard set ended with %v, want ErrHostGone", old.id, err)
	}
	if owned := old.set.Owned(); len(owned) != 0 {
		m.t.Fatalf("%s taken over: its old shard set ended owning %v", old.id, owned)
	}
	return fmt.Sprintf("%s by %s (weight %v, zone %s; the old set ended %v after the takeover)", old.label, mb.label, mb.rank.Weight, mb.rank.Zone,
		time.Since(began).Round(time.Millisecond))
}

// bystander registers a host that runs no shard set.
func (m *shModel) bystander() string {
	h := m.host(m.nextID(), LivenessOptions{})
	m.bys = append(m.bys, h)
	m.bystanders[h.id] = true
	return h.id
}

// bystanderStep starts a bystander while there are fewer than two, or
// stops one or starts another.
func (m *shModel) bystanderStep() string {
	if len(m.bys) < 2 || m.rng.IntN(2) == 0 {
		return "bystander " + m.bystander()
	}
	i := m.rng.IntN(len(m.bys))
	h := m.bys[i]
	m.bys = slices.Delete(m.bys, i, i+1)
	delete(m.bystanders, h.id)
	return "bystander " + h.id + " stops" + m.stop(h)
}

// cut cuts a live member off for d, then heals its link.
func (m *shModel) cut(d time.Duration) string {
	h := m.live[m.rng.IntN(len(m.live))]
	h.px.Blackhole()
	<-time.After(d)
	h.px.Unblackhole()
	return fmt.Sprintf("%s for %v", h.label, d.Round(time.Millisecond))
}

// lag slows a live member's link by d each way for long, then gives it
// its speed back (or the slow link's it had): slow enough that its leases
// may expire.
func (m *shModel) lag(d, long time.Duration) string {
	h := m.live[m.rng.IntN(len(m.live))]
	h.px.Delay(d)
	<-time.After(long)
	h.px.Delay(m.slow[h.shHost])
	return fmt.Sprintf("%s by %v for %v", h.label, d.Round(time.Millisecond), long.Round(time.Millisecond))
}

// delay slows a live member's link by d each way (or more, as it was
// already) until the next heal.
func (m *shModel) delay(d time.Duration) string {
	h := m.live[m.rng.IntN(len(m.live))]
	if m.slow == nil {
		m.slow = map[*shHost]time.Duration{}
	}
	m.slow[h.shHost] = max(m.slow[h.shHost], d)
	h.px.Delay(m.slow[h.shHost])
	return fmt.Sprintf("%s by %v", h.label, d.Round(time.Millisecond))
}

// heal gives every slow link its speed back.
func (m *shModel) heal() {
	for h := range m.slow {
		h.px.Delay(0)
	}
	m.slow = nil
}

// owners returns, for each shard, the label of the member that ranks
// first for it among the live members, as a ShardSet ranks them:
// bystanders, members gone and draining ones take no part.
func (m *shModel) owners() map[string]string {
	var members []ShardMember
	label := map[string]string{}
	for _, h := range m.live {
		members = append(members, h.rank)
		label[h.id] = h.label
	}
	want := map[string]string{}
	for _, s := range m.shards {
		want[s] = label[smPick(s, members, 1)[0].HostUUID]
	}
	return want
}

// settle waits until every shard is owned by the member that ranks first
// for it (see owners), and by no other shard set of the model, live or
// gone, failing after the TTL and a slack from the end of the last fault;
// it returns how long after that it found them settled.
// The slack covers a host's heal after a cut (its backoff), the handoff
// (Settle, a campaign, the old owner's step-down), and a few round trips
// of the slowest link.
func (m *shModel) settle(after string) time.Duration {
	m.t.Helper()
	var slowest time.Duration
	for _, d := range m.slow {
		slowest = max(slowest, d)
	}
	limit := m.ttl + m.ttl + maxBackoff*scale + 6*2*slowest
	want := m.owners()
	began := cmp.Or(m.faultEnd, time.Now())
	deadline := time.After(time.Until(began.Add(limit)))
	for {
		m.l.mu.Lock()
		changed := m.l.changed
		m.l.mu.Unlock()
		got := m.owned()
		if m.agree(got, want) {
			return time.Since(began)
		}
		select {
		case <-changed:
		case <-time.After(10 * time.Millisecond): // Owned may change without a signal (a leadership lost)
		case <-deadline:
			m.t.Fatalf("after %s, not settled within %v: owners %v, want %v (members %v, bystanders %v)",
				after, limit, got, want, m.ranks(), slices.Sorted(maps.Keys(m.bystanders)))
		}
	}
}

// owned returns, for each shard, the labels of the shard sets of the
// model that own it now.
func (m *shModel) owned() map[string][]string {
	got := map[string][]string{}
	for _, h := range m.all {
		for _, s := range h.set.Owned() {
			got[s.Name] = append(got[s.Name], h.label)
		}
	}
	return got
}

// agree reports whether each shard is owned by its wanted owner alone.
func (m *shModel) agree(got map[string][]string, want map[string]string) bool {
	for _, s := range m.shards {
		if !slices.Equal(got[s], []string{want[s]}) {
			return false
		}
	}
	return true
}

// ranks returns the live members as they announce themselves.
func (m *shModel) ranks() []ShardMember {
	var out []ShardMember
	for _, h := range m.live {
		out = append(out, h.rank)
	}
	return out
}

// noBystanderCandidate checks that every candidate of every shard in
// etcd is a member's: no bystander, live or gone, ever campaigns.
func (m *shModel) noBystanderCandidate() {
	members := m.memberIDs()
	for s, ids := range shCandidates(m.t, m.srv.Client(), m.shards) {
		for _, id := range ids {
			if !members[id] {
				m.t.Fatalf("%s, no member, is a candidate of %s", id, s)
			}
		}
	}
}

// memberIDs returns the HostUUIDs of every member ever started.
func (m *shModel) memberIDs() map[string]bool {
	ids := map[string]bool{}
	for _, h := range m.all {
		ids[h.id] = true
	}
	return ids
}

// noBystanderWrite checks that no write of ws, nor any shard signal,
// came from a host that was ever a bystander.
func (m *shModel) noBystanderWrite(ws []shWrite) {
	members := m.memberIDs()
	for _, w := range ws {
		if id, _, _ := strings.Cut(w.host, "."); !members[id] {
			m.t.Fatalf("%s of shard %s (token %d) is no member's", w.host, w.shard, w.token)
		}
	}
	m.l.mu.Lock()
	defer m.l.mu.Unlock()
	for _, ev := range m.l.events {
		if !members[ev.Host] {
			m.t.Fatalf("signal %v of %s by %s, no member", ev.Kind, ev.Shard, ev.Host)
		}
	}
}
