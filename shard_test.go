package coord

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/go-coord/coord/coordtest"
)

// shWork is where the Runs of the tests write their shards' work.
const shWork = "/test/work/"

// shPace paces the writes of a Run: a workload, not a synchronisation.
const shPace = 20 * time.Millisecond

// shNames returns n shard names.
func shNames(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("shard-%04d", i)
	}
	return names
}

// shIDs returns n host UUIDs.
func shIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("host-%02d", i)
	}
	return ids
}

// shRank returns hosts ranked for shard, best first, as every ShardSet
// ranks them.
func shRank(shard string, hosts []string) []string { return RankHosts(shard, hosts) }

// shRankedAs returns the first shard name s0, s1, … whose ranking of
// hosts is hosts in the order given.
func shRankedAs(hosts ...string) string {
	for i := 0; ; i++ {
		if name := fmt.Sprintf("s%d", i); slices.Equal(shRank(name, hosts), hosts) {
			return name
		}
	}
}

// shTops returns the best-ranked host of each shard.
func shTops(shards, hosts []string) map[string]string {
	top := map[string]string{}
	for _, s := range shards {
		top[s] = shRank(s, hosts)[0]
	}
	return top
}

// shCount returns how many shards each host tops.
func shCount(top map[string]string) map[string]int {
	n := map[string]int{}
	for _, h := range top {
		n[h]++
	}
	return n
}

// shOrdered returns a and b such that b ranks before a for shard.
func shOrdered(shard, a, b string) (string, string) {
	if ranksBefore(shard, a, b) {
		return b, a
	}
	return a, b
}

// shEvent is a shard signal and when it came.
type shEvent struct {
	Signal
	at time.Time
}

// shWrite is a fenced write that etcd accepted.
type shWrite struct {
	shard, host string
	token, rev  int64
}

// shLedger records the shard signals and the fenced writes of every host
// of a test, and wakes those waiting for a state at each signal.
type shLedger struct {
	mu      sync.Mutex
	events  []shEvent
	writes  []shWrite
	changed chan struct{} // closed and replaced at each signal

	seq     atomic.Int64   // numbers the writes, so that each writes a value of its own
	hist    *fhHistory     // if set, records every write, whatever its outcome
	clients map[string]int // hist's client of each host and shard
}

func newShLedger() *shLedger { return &shLedger{changed: make(chan struct{})} }

// hook is an OnSignal that records the shard signals.
func (l *shLedger) hook(sig Signal) {
	if sig.Kind != SignalShardAcquired && sig.Kind != SignalShardReleased {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, shEvent{sig, time.Now()})
	close(l.changed)
	l.changed = make(chan struct{})
}

// until waits until cond holds, checking it again at each shard signal
// (ownership changes before its signal is sent), failing after patience.
func (l *shLedger) until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(patience())
	for {
		l.mu.Lock()
		changed := l.changed
		l.mu.Unlock()
		if cond() {
			return
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("not %s before the deadline", what)
		}
	}
}

// held returns the {host, shard} pairs whose last signal was an
// acquisition.
func (l *shLedger) held() map[[2]string]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[[2]string]bool{}
	for _, ev := range l.events {
		out[[2]string{ev.Host, ev.Shard}] = ev.Kind == SignalShardAcquired
	}
	return out
}

// mark returns the position of the next event.
func (l *shLedger) mark() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.events)
}

// since returns the events of kind from position i on.
func (l *shLedger) since(i int, kind SignalKind) []shEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []shEvent
	for _, ev := range l.events[i:] {
		if ev.Kind == kind {
			out = append(out, ev)
		}
	}
	return out
}

// waitEvent waits for an event of kind about shard by host from position
// i on, and returns it.
func (l *shLedger) waitEvent(t *testing.T, i int, kind SignalKind, host, shard string) shEvent {
	t.Helper()
	var found shEvent
	l.until(t, fmt.Sprintf("%v of %s by %s", kind, shard, host), func() bool {
		for _, ev := range l.since(i, kind) {
			if ev.Host == host && ev.Shard == shard {
				found = ev
				return true
			}
		}
		return false
	})
	return found
}

// write puts the shard's work through cli under its Guard, and records it
// if etcd accepted it (and in l.hist, if set, whatever the outcome).
func (l *shLedger) write(cli *clientv3.Client, host string, s Shard) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	value := fmt.Sprintf("%s/%d/%d", host, s.Token, l.seq.Add(1))
	resp, err := l.hist.write(l.client(host, s.Name), shWork+s.Name, host, s.Token, value, func() (*clientv3.TxnResponse, error) {
		return cli.Txn(ctx).If(s.Guard).Then(clientv3.OpPut(shWork+s.Name, value)).Commit()
	})
	if err != nil || !resp.Succeeded {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.writes = append(l.writes, shWrite{s.Name, host, s.Token, resp.Header.Revision})
	return true
}

// client returns l.hist's client of host's writes to shard.
func (l *shLedger) client(host, shard string) int {
	if l.hist == nil {
		return 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.clients == nil {
		l.clients = map[string]int{}
	}
	id, ok := l.clients[host+" "+shard]
	if !ok {
		id = l.hist.client()
		l.clients[host+" "+shard] = id
	}
	return id
}

// writer returns a Run that writes its shard's work under its Guard until
// its ctx ends.
func (l *shLedger) writer(cli *clientv3.Client, host string) func(context.Context, Shard) {
	return func(ctx context.Context, s Shard) {
		for ctx.Err() == nil {
			l.write(cli, host, s)
			select {
			case <-ctx.Done():
			case <-time.After(shPace):
			}
		}
	}
}

// acked returns the writes whose success etcd answered.
func (l *shLedger) acked() []shWrite {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.writes)
}

// waitWrites waits until host has n more answered writes than it had
// when before was taken (see writesOf).
func (l *shLedger) waitWrites(t *testing.T, host string, before, n int) {
	t.Helper()
	eventually(t, fmt.Sprintf("%d more writes of %s", n, host), func() bool { return l.writesOf(host) >= before+n })
}

// writesOf returns how many answered writes host made.
func (l *shLedger) writesOf(host string) int {
	n := 0
	for _, w := range l.acked() {
		if w.host == host {
			n++
		}
	}
	return n
}

// shHistory returns every write of the Runs that etcd applied, answered
// or not, from the history of their keys (the tests that use it do not
// compact).
func shHistory(t *testing.T, cli *clientv3.Client) []shWrite {
	t.Helper()
	var out []shWrite
	shReplay(t, cli, shWork, func(ev *clientv3.Event) {
		host, rest, _ := strings.Cut(string(ev.Kv.Value), "/")
		token, _, _ := strings.Cut(rest, "/")
		tok, err := strconv.ParseInt(token, 10, 64)
		if err != nil {
			t.Fatalf("history: %q: %v", ev.Kv.Value, err)
		}
		out = append(out, shWrite{strings.TrimPrefix(string(ev.Kv.Key), shWork), host, tok, ev.Kv.ModRevision})
	})
	return out
}

// shReplay hands each event of prefix's whole history to each, up to a
// key it puts under prefix last.
func shReplay(t *testing.T, cli *clientv3.Client, prefix string, each func(*clientv3.Event)) {
	t.Helper()
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	end, err := cli.Put(ctx, prefix+"~end", "")
	if err != nil {
		t.Fatal(err)
	}
	for wr := range cli.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(1)) {
		if wr.Err() != nil {
			t.Fatalf("history of %s: %v", prefix, wr.Err())
		}
		for _, ev := range wr.Events {
			if ev.Kv.ModRevision == end.Header.Revision {
				return
			}
			each(ev)
		}
	}
	t.Fatalf("history of %s cut short", prefix)
}

// shCheck goes through the fenced writes of each shard in etcd's order: a
// token never goes back, and a token is one host's. It returns the writes
// that break that (overlaps) and the handoffs (token changes).
func shCheck(ws []shWrite) (overlaps, handoffs int) {
	by := map[string][]shWrite{}
	for _, w := range ws {
		by[w.shard] = append(by[w.shard], w)
	}
	for _, ws := range by {
		slices.SortFunc(ws, func(a, b shWrite) int { return cmp.Compare(a.rev, b.rev) })
		for i := 1; i < len(ws); i++ {
			p, w := ws[i-1], ws[i]
			switch {
			case w.token < p.token || w.token == p.token && w.host != p.host:
				overlaps++
			case w.token > p.token:
				handoffs++
			}
		}
	}
	return overlaps, handoffs
}

// idle is a Run that waits for its ctx to end.
func idle(ctx context.Context, _ Shard) { <-ctx.Done() }

// shHost is a host of a test: its link to etcd, client, registration
// and shard set.
type shHost struct {
	id   string
	px   *coordtest.Proxy
	cli  *clientv3.Client
	live *HostLiveness
	set  *ShardSet
}

// shRegister registers each id on a client of its own, through a proxy of
// its own, with a liveness TTL of 1 s × COORD_TEST_SCALE: under emulation
// a lease of 1 s can lapse for want of CPU, and the host, seen down,
// loses shards.
func shRegister(t *testing.T, srv *coordtest.Server, ids ...string) []*shHost {
	t.Helper()
	var hs []*shHost
	for _, id := range ids {
		h := &shHost{id: id, px: srv.NewProxy(t)}
		h.cli = h.px.NewClient(t)
		h.live = register(t, h.cli, id, LivenessOptions{TTL: time.Second * scale})
		hs = append(hs, h)
	}
	return hs
}

// shFleet starts an etcd with a ledger, n shard names and m hosts
// registered (see shRegister), their shard sets not started.
func shFleet(t *testing.T, n, m int) (*coordtest.Server, *shLedger, []string, []*shHost) {
	t.Helper()
	srv, _ := newEtcd(t)
	return srv, newShLedger(), shNames(n), shRegister(t, srv, shIDs(m)...)
}

// shRanked starts an etcd with a ledger and registers two hosts, a and
// b, a ranking before b for shard.
func shRanked(t *testing.T, shard string) (srv *coordtest.Server, l *shLedger, a, b *shHost) {
	t.Helper()
	srv, _ = newEtcd(t)
	bID, aID := shOrdered(shard, "host-b", "host-a")
	hs := shRegister(t, srv, aID, bID)
	return srv, newShLedger(), hs[0], hs[1]
}

// crash makes h crash: nothing more of it reaches etcd, where its leases
// expire, and its client is closed.
func (h *shHost) crash() {
	h.px.Blackhole()
	h.cli.Close()
}

// start starts h's shard set with opts, closed at the end of the test.
// Unset: TTL 2s×scale, Run idle, OnSignal l.hook.
func (h *shHost) start(t *testing.T, l *shLedger, opts ShardOptions) *shHost {
	t.Helper()
	h.set = shSet(t, h.cli, h.id, l, opts)
	return h
}

// shStartAll starts a shard set on each of hosts with opts (the Logger,
// if any, saying which host logs), and waits until opts.Shards settle; it
// returns their owners.
func shStartAll(t *testing.T, l *shLedger, hosts []*shHost, opts ShardOptions) map[string]string {
	t.Helper()
	for _, h := range hosts {
		o := opts
		if o.Logger != nil {
			o.Logger = o.Logger.With("host", h.id)
		}
		h.start(t, l, o)
	}
	return shSettle(t, l, opts.Shards, hosts, hosts)
}

// shSet starts a shard set of self on cli (see shHost.start).
func shSet(t *testing.T, cli *clientv3.Client, self string, l *shLedger, opts ShardOptions) *ShardSet {
	t.Helper()
	opts.Self = self
	if opts.TTL == 0 {
		opts.TTL = 2 * time.Second * scale
	}
	if opts.Run == nil {
		opts.Run = idle
	}
	if opts.OnSignal == nil {
		opts.OnSignal = l.hook
	}
	s, err := NewShardSet(testCtx(t), cli, opts)
	if err != nil {
		t.Fatalf("NewShardSet(%s): %v", self, err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// shIDsOf returns the ids of hosts.
func shIDsOf(hosts []*shHost) []string {
	var ids []string
	for _, h := range hosts {
		ids = append(ids, h.id)
	}
	return ids
}

// shOwners returns, for each shard, the hosts whose Owned lists it.
func shOwners(hosts []*shHost) map[string][]string {
	owners := map[string][]string{}
	for _, h := range hosts {
		if h.set == nil {
			continue
		}
		for _, s := range h.set.Owned() {
			owners[s.Name] = append(owners[s.Name], h.id)
		}
	}
	return owners
}

// shSettle waits until each shard is owned by its best-ranked host among
// live, and by no other host of all, and the signals of the live hosts say
// the same (a host owns a shard just before it signals so); it returns the
// owners.
func shSettle(t *testing.T, l *shLedger, shards []string, live, all []*shHost) map[string]string {
	t.Helper()
	top := shTops(shards, shIDsOf(live))
	var wrong, bad []string // at the last look: what is wrong, of which shards
	t.Cleanup(func() {
		if t.Failed() && len(wrong) > 0 {
			t.Logf("at the last look, %d shards not settled, the first: %v", len(wrong), wrong[:min(len(wrong), 8)])
			for _, h := range all {
				if h.set != nil {
					h.set.mu.Lock()
					t.Logf("%s: view at revision %d, listed %v, hosts synced %v, members %d, moves %d, handing %d, unsettled %d",
						h.id, h.set.view.rev, h.set.view.candsListed, h.set.view.hostsSynced, len(h.set.view.members), h.set.moves.inFlight, h.set.hands.inFlight, len(h.set.settle.unsettled))
					for _, sh := range bad[:min(len(bad), 8)] {
						w, at := h.set.workers[sh], int64(-1) // -1: not followed
						if f := h.set.view.follows[sh]; f != nil {
							at = f.at
						}
						t.Logf("  %s: worker %v, running %v, candidates %v (at revision %d), ranked %v", sh, w != nil, w != nil && w.stopRun != nil, h.set.view.cands[sh], at, h.set.rank.ranked[sh])
					}
					h.set.mu.Unlock()
				}
			}
		}
	})
	l.until(t, "settled", func() bool {
		owners, held := shOwners(all), l.held()
		wrong, bad = nil, nil
		for _, s := range shards {
			if !slices.Equal(owners[s], []string{top[s]}) {
				wrong, bad = append(wrong, fmt.Sprintf("%s owned by %v, ranked first: %s", s, owners[s], top[s])), append(bad, s)
				continue
			}
			for _, h := range live {
				if held[[2]string{h.id, s}] != (h.id == top[s]) {
					wrong, bad = append(wrong, fmt.Sprintf("%s: %s's signals say held %v", s, h.id, held[[2]string{h.id, s}])), append(bad, s)
				}
			}
		}
		return len(wrong) == 0
	})
	return top
}

// shP99 returns the 99th percentile of ds.
func shP99(ds []time.Duration) time.Duration {
	ds = slices.Clone(ds)
	slices.Sort(ds)
	return ds[int(math.Ceil(0.99*float64(len(ds))))-1]
}

// shFair checks that got, the count of one of m equally likely outcomes
// in k draws, is what a fair draw gives: within 4 standard deviations of
// k/m. A rendezvous hash assigns each shard independently, so its spread is
// a fair draw's at best: at K/N = 128 one standard deviation is 8.7% of
// the mean, and among 32 hosts the farthest is typically 2 to 3 of them
// away.
func shFair(got, k, m int) (dev, sigmas float64, ok bool) {
	p := 1 / float64(m)
	mean, sd := float64(k)*p, math.Sqrt(float64(k)*p*(1-p))
	d := float64(got) - mean
	return d / mean, d / sd, math.Abs(d) <= 4*sd
}

func TestShardRanking(t *testing.T) {
	const k, n = 4096, 32
	shards, hosts := shNames(k), shIDs(n+1)
	t.Run("4096 shards spread over 32 hosts as a fair draw", func(t *testing.T) {
		counts := shCount(shTops(shards, hosts[:n]))
		var sum float64
		for _, h := range hosts[:n] {
			_, sigmas, ok := shFair(counts[h], k, n)
			sum += sigmas * sigmas
			if !ok {
				t.Fatalf("%s tops %d shards: %+.1fσ from K/N", h, counts[h], sigmas)
			}
		}
		all := slices.Sorted(maps.Values(counts))
		rms := math.Sqrt(sum / n)
		t.Logf("K=%d N=%d: %d to %d shards per host, K/N = %d (%+.1f%% to %+.1f%%), %.2fσ on average; per host %v",
			k, n, all[0], all[n-1], k/n, 100*(float64(all[0]*n)/k-1), 100*(float64(all[n-1]*n)/k-1), rms, all)
		// The spread as a whole is a fair draw's: its variance is the
		// binomial one.
		if rms < 0.7 || rms > 1.3 {
			t.Fatalf("spread %.2fσ on average, a fair draw gives 1", rms)
		}
	})
	t.Run("RankMembers: RankHosts for one weight; draining members last; a heavier member first more often", func(t *testing.T) {
		heavy := 0
		for _, sh := range shards[:256] {
			members := []ShardMember{{HostUUID: hosts[0], Weight: 1}, {HostUUID: hosts[1], Weight: 1}, {HostUUID: hosts[2], Weight: 1}}
			var got []string
			for _, m := range RankMembers(sh, members) {
				got = append(got, m.HostUUID)
			}
			if want := RankHosts(sh, hosts[:3]); !slices.Equal(got, want) {
				t.Fatalf("%s: RankMembers %v, RankHosts %v", sh, got, want)
			}
			members[0].Draining = true
			if r := RankMembers(sh, members); r[2].HostUUID != hosts[0] || members[0].HostUUID != hosts[0] {
				t.Fatalf("%s: the draining member ranks %v; members changed: %v", sh, r, members)
			}
			members[0].Draining, members[1].Weight = false, 4
			if RankMembers(sh, members)[0].HostUUID == hosts[1] {
				heavy++
			}
		}
		// Weight 4 of 6: first with p = 2/3 (σ 7.5 in 256 draws).
		if heavy < 140 || heavy > 200 {
			t.Fatalf("the member of weight 4 ranks first for %d of 256 shards, want about 171", heavy)
		}
	})
	t.Run("a host joining takes about K/(N+1) shards, all from others; leaving gives back only its own", func(t *testing.T) {
		before, after := shTops(shards, hosts[:n]), shTops(shards, hosts)
		joined := hosts[n]
		moved := 0
		for _, s := range shards {
			if before[s] != after[s] {
				moved++
				if after[s] != joined {
					t.Fatalf("%s moved from %s to %s, not to the host that joined", s, before[s], after[s])
				}
			}
		}
		dev, sigmas, ok := shFair(moved, k, n+1)
		t.Logf("join: %d of %d shards moved, all to the new host (K/(N+1) = %.0f: %+.1f%%, %+.1fσ)", moved, k, float64(k)/(n+1), 100*dev, sigmas)
		if !ok {
			t.Fatalf("%d shards moved: %+.1fσ from K/(N+1)", moved, sigmas)
		}
		// A host leaving: what it topped goes to the next-ranked, the
		// rest stays.
		left := hosts[3]
		rest := slices.DeleteFunc(slices.Clone(hosts[:n]), func(h string) bool { return h == left })
		gone := shTops(shards, rest)
		moved = 0
		for _, s := range shards {
			if (before[s] != gone[s]) != (before[s] == left) {
				t.Fatalf("%s: %s before, %s after %s left", s, before[s], gone[s], left)
			}
			if before[s] != gone[s] {
				moved++
			}
		}
		t.Logf("leave: %d of %d shards moved, all %s's", moved, k, left)
	})
}

// TestRankHosts pins the ranking with golden values: it is wire format,
// shared by every agent of a fleet whatever its version. A change makes
// old and new agents rank differently during a rolling upgrade: more
// than Replicas hosts might campaign for a shard, or none. The values
// were computed once, and checked against another implementation of
// FNV-1a 64 and splitmix64's finalizer: they must never be regenerated.
func TestRankHosts(t *testing.T) {
	t.Run("weight is FNV-1a 64 of shard, a zero byte and host, spread by splitmix64", func(t *testing.T) {
		golden := []struct {
			shard, host string
			want        uint64
		}{
			{"", "", 0x25fc6dd36ce04b20},
			// The zero byte keeps apart what concatenation would not.
			{"", "a", 0x16bc26fa3458bfad},
			{"a", "", 0xd0137a57d0ef408f},
			{"ab", "c", 0x9291f5e7171dc35a},
			{"a", "bc", 0x82a144826e72d59e},
			{"abc", "", 0x6b8ac9656e35720f},
			{"", "abc", 0x162a62a8a536e445},
			{"s", "a", 0xffd14d5b7a07997d},
			{"s", "b", 0x716bfd52addc8f31},
			{"shard-0000", "host-00", 0x544194b3ab55851b},
			{"shard-0000", "host-01", 0x34f47077fd23df16},
			{"shard-0001", "host-00", 0xbc57a8eeb07e3e31},
			{"shard-4095", "host-32", 0x5eb38b168d830d90},
			// UTF-8 is hashed byte by byte.
			{"café", "hôte-é", 0x3f030bc6e4271dd6},
			{"orders-eu", "6f1c2e9a-3b7d-4c2a-9e1f-0a5b8c7d6e4f", 0xbe445b3a049bd548},
		}
		for _, g := range golden {
			if got := weight(g.shard, g.host); got != g.want {
				t.Errorf("weight(%q, %q) = %#016x, want %#016x", g.shard, g.host, got, g.want)
			}
		}
	})
	t.Run("RankHosts orders by weight, highest first, and leaves its input alone", func(t *testing.T) {
		hosts := []string{"host-00", "host-01", "host-02", "host-03", "host-04", "host-05"}
		golden := []struct {
			shard string
			hosts []string
			want  []string
		}{
			{"s", hosts, []string{"host-02", "host-04", "host-03", "host-01", "host-05", "host-00"}},
			{"shard-0000", hosts, []string{"host-03", "host-04", "host-00", "host-01", "host-05", "host-02"}},
			{"shard-0001", hosts, []string{"host-03", "host-05", "host-00", "host-02", "host-04", "host-01"}},
			{"orders-eu", hosts, []string{"host-04", "host-00", "host-03", "host-02", "host-01", "host-05"}},
			{"ab", []string{"c", "bc", "a", "abc", ""}, []string{"", "abc", "bc", "c", "a"}},
			{"s", nil, nil},
		}
		for _, g := range golden {
			in := slices.Clone(g.hosts)
			if got := RankHosts(g.shard, in); !slices.Equal(got, g.want) {
				t.Errorf("RankHosts(%q, %q) = %q, want %q", g.shard, g.hosts, got, g.want)
			}
			if !slices.Equal(in, g.hosts) {
				t.Errorf("RankHosts(%q, ...) changed its input to %q", g.shard, in)
			}
		}
	})
}

func TestShardSpread(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	_, l, shards, hosts := shFleet(t, 64, 4)
	shStartAll(t, l, hosts, ShardOptions{Shards: shards})
	mean := float64(len(shards)) / float64(len(hosts))
	for _, h := range hosts {
		n := len(h.set.Owned())
		t.Logf("K=64 N=4: %s owns %d shards (K/N = %.0f, %+.0f%%)", h.id, n, mean, 100*(float64(n)/mean-1))
		if float64(n) < 0.5*mean || float64(n) > 1.5*mean {
			t.Fatalf("%s owns %d shards, want within ±50%% of %.0f", h.id, n, mean)
		}
	}
}

// shMoves checks that the shard signals from mark on are those of the
// moves from one owner to another (by shard) and no more: each shard that
// moved released once by its owner, because of why, and acquired once by
// its new one. It returns the shards that moved.
func shMoves(t *testing.T, l *shLedger, mark int, from, to map[string]string, why error) []string {
	t.Helper()
	var moved []string
	for s, h := range to {
		if from[s] != h {
			moved = append(moved, s)
		}
	}
	acq, rel := l.since(mark, SignalShardAcquired), l.since(mark, SignalShardReleased)
	for _, ev := range acq {
		if from[ev.Shard] == to[ev.Shard] || ev.Host != to[ev.Shard] {
			t.Fatalf("%s acquired %s, which moved from %s to %s", ev.Host, ev.Shard, from[ev.Shard], to[ev.Shard])
		}
	}
	for _, ev := range rel {
		if from[ev.Shard] == to[ev.Shard] || ev.Host != from[ev.Shard] || !errors.Is(ev.Err, why) {
			t.Fatalf("%s released %s (%v), which moved from %s to %s", ev.Host, ev.Shard, ev.Err, from[ev.Shard], to[ev.Shard])
		}
	}
	if len(acq) != len(moved) || len(rel) != len(moved) {
		t.Fatalf("%d acquired, %d released, %d moved", len(acq), len(rel), len(moved))
	}
	slices.Sort(moved)
	return moved
}

// shTopReplicas returns, for each shard, its top replicas among live,
// sorted: the hosts that must campaign for it.
func shTopReplicas(shards, live []string, replicas int) map[string][]string {
	out := map[string][]string{}
	for _, s := range shards {
		top := shRank(s, live)
		out[s] = slices.Sorted(slices.Values(top[:min(replicas, len(top))]))
	}
	return out
}

// shCandidates returns, for each shard, the identities of its candidates
// in etcd, sorted.
func shCandidates(t *testing.T, cli *clientv3.Client, shards []string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, s := range shards {
		var ids []string
		for _, kv := range candidates(t, cli, ShardsPrefix+s+"/") {
			ids = append(ids, string(kv.Value))
		}
		slices.Sort(ids)
		out[s] = ids
	}
	return out
}

// shCampaigning returns, for each shard, the hosts whose shard set
// campaigns for it (or runs it), sorted.
func shCampaigning(hosts []*shHost, shards []string) map[string][]string {
	out := map[string][]string{}
	for _, s := range shards {
		var ids []string
		for _, h := range hosts {
			h.set.mu.Lock()
			if h.set.workers[s] != nil {
				ids = append(ids, h.id)
			}
			h.set.mu.Unlock()
		}
		out[s] = ids
	}
	return out
}

// shSettleCandidates waits until each shard's candidates in etcd are its
// top replicas live hosts (all of hosts), and are those of the campaigns
// going on, none missing: a host that campaigns when it should not has its
// key in etcd by then. It returns the candidates.
func shSettleCandidates(t *testing.T, cli *clientv3.Client, shards []string, hosts []*shHost, replicas int) map[string][]string {
	t.Helper()
	want := shTopReplicas(shards, shIDsOf(hosts), replicas)
	deadline := time.Now().Add(patience())
	for {
		got, campaigning := shCandidates(t, cli, shards), shCampaigning(hosts, shards)
		if maps.EqualFunc(got, want, slices.Equal) && maps.EqualFunc(got, campaigning, slices.Equal) {
			return got
		}
		if time.Now().After(deadline) {
			for _, s := range shards {
				t.Logf("%s: candidates %v, campaigning %v, want the top %d of %v: %v",
					s, got[s], campaigning[s], replicas, shRank(s, shIDsOf(hosts)), want[s])
			}
			t.Fatalf("the candidates are not the top %d live hosts of each shard at the deadline", replicas)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestShardReplicas(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	for _, replicas := range []int{1, 2} {
		name := fmt.Sprintf("Replicas %d: the top %d live hosts of each shard campaign, and a host pushed out withdraws", replicas, replicas)
		t.Run(name, func(t *testing.T) {
			srv, _ := newEtcd(t)
			cli, l := srv.Client(), newShLedger()
			ids := shIDs(5)
			// Shards that the host joining later tops (two), ranks second
			// for (two), or lower (four).
			var shards []string
			picked := map[int]int{}
			for _, s := range shNames(100) {
				pos := min(slices.Index(shRank(s, ids), ids[4]), 2)
				if picked[pos] < 2 || pos == 2 && picked[pos] < 4 {
					picked[pos]++
					shards = append(shards, s)
				}
			}
			hosts := shRegister(t, srv, ids[:4]...)
			opts := ShardOptions{Shards: shards, Replicas: replicas}
			shStartAll(t, l, hosts, opts)
			before := shSettleCandidates(t, cli, shards, hosts, replicas)

			// A host joins: where it ranks among the top, the host it
			// pushes out withdraws its candidacy.
			joined := shRegister(t, srv, ids[4])[0]
			hosts = append(hosts, joined.start(t, l, opts))
			after := shSettleCandidates(t, cli, shards, hosts, replicas)
			var pushed []string
			for _, s := range shards {
				for _, h := range before[s] {
					if !slices.Contains(after[s], h) {
						pushed = append(pushed, h+" of "+s)
					}
				}
			}
			t.Logf("%s joined: pushed out %v", joined.id, pushed)
			if len(pushed) == 0 {
				t.Fatalf("%s pushed no host out of any shard's top %d", joined.id, replicas)
			}
		})
	}
}

func TestShardMovement(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	srv, _ := newEtcd(t)
	l := newShLedger()
	tap, tlog := newLogTap()
	tap.dumpOnFailure(t)
	shards := shNames(24)
	hosts := shRegister(t, srv, shIDs(3)...)
	before := shStartAll(t, l, hosts, ShardOptions{Shards: shards, Logger: tlog})

	// Join: only the shards the new host tops move, all to it.
	mark := l.mark()
	joined := shRegister(t, srv, "host-03")[0]
	hosts = append(hosts, joined.start(t, l, ShardOptions{Shards: shards, Logger: tlog.With("host", "host-03")}))
	after := shSettle(t, l, shards, hosts, hosts)
	moved := shMoves(t, l, mark, before, after, errBetterHost)
	t.Logf("join: %d of %d shards moved, all to %s (K/(N+1) = %.0f)", len(moved), len(shards), joined.id, float64(len(shards))/4)
	if len(moved) == 0 || len(moved) > len(shards)/2 {
		t.Fatalf("join moved %d shards, want about %d", len(moved), len(shards)/4)
	}
	for _, s := range moved {
		if after[s] != joined.id {
			t.Fatalf("%s moved to %s", s, after[s])
		}
	}

	// Leave: only the leaver's shards move, to their next-ranked hosts.
	mark = l.mark()
	leaver := hosts[1]
	leaver.set.Close()
	if err := leaver.live.Stop(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	rest := []*shHost{hosts[0], hosts[2], hosts[3]}
	moved = shMoves(t, l, mark, after, shSettle(t, l, shards, rest, hosts), ErrClosed)
	for _, s := range moved {
		if after[s] != leaver.id {
			t.Fatalf("%s moved from %s", s, after[s])
		}
	}
	t.Logf("leave: %d of %d shards moved, all %s's", len(moved), len(shards), leaver.id)
}

func TestShardFailover(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	_, l, shards, hosts := shFleet(t, 32, 4)
	ttl := 2 * time.Second * scale
	tap, log := newLogTap()
	owners := shStartAll(t, l, hosts, ShardOptions{Shards: shards, TTL: ttl, Logger: log})
	// The victim: the host that owns most.
	victim := slices.MaxFunc(hosts, func(a, b *shHost) int { return len(a.set.Owned()) - len(b.set.Owned()) })
	var lost []string
	for _, s := range shards {
		if owners[s] == victim.id {
			lost = append(lost, s)
		}
	}
	mark := l.mark()
	// A crash: nothing more reaches etcd from the victim, its leases
	// expire.
	crash := time.Now()
	victim.crash()
	rest := slices.DeleteFunc(slices.Clone(hosts), func(h *shHost) bool { return h == victim })
	shSettle(t, l, shards, rest, hosts)
	var took []time.Duration
	for _, s := range lost {
		ev := l.waitEvent(t, mark, SignalShardAcquired, shTops([]string{s}, shIDsOf(rest))[s], s)
		took = append(took, ev.at.Sub(crash))
	}
	p99 := shP99(took)
	t.Logf("failover of %d shards, TTL %v: p99 %v, min %v", len(took), ttl, p99, slices.Min(took))
	if p99 > ttl+time.Second*scale {
		t.Fatalf("failover p99 %v, want within TTL + 1s = %v", p99, ttl+time.Second*scale)
	}
	// What the shard sets logged of a shard that should not have moved.
	explain := func(shard string) {
		for _, line := range tap.lines() {
			if strings.Contains(line, shard) {
				t.Log(line)
			}
		}
	}
	// The crashed host's shard set saw its client closed: its Runs ended.
	for _, ev := range l.since(mark, SignalShardReleased) {
		if ev.Host != victim.id || !errors.Is(ev.Err, ErrClientClosed) {
			explain(ev.Shard)
			t.Fatalf("%s released %s because %v", ev.Host, ev.Shard, ev.Err)
		}
	}
	for _, ev := range l.since(mark, SignalShardAcquired) {
		if !slices.Contains(lost, ev.Shard) {
			explain(ev.Shard)
			t.Fatalf("%s acquired %s, which the crashed host did not own", ev.Host, ev.Shard)
		}
	}
	if got := victim.set.Owned(); len(got) != 0 {
		t.Fatalf("the crashed host owns %v", got)
	}
}

// shDrainer is a Run that writes until its ctx ends, then for drain more,
// and checks meanwhile that it is alone: its own shard set lists the
// shard, the other does not.
type shDrainer struct {
	l           *shLedger
	h           *shHost
	drain       time.Duration
	self, other atomic.Pointer[ShardSet]
	ended       chan time.Time // when Run saw its ctx end
	drained     atomic.Int32   // writes accepted during the drain
	errorf      func(string, ...any)
}

func (d *shDrainer) run(ctx context.Context, s Shard) {
	d.l.writer(d.h.cli, d.h.id)(ctx, s)
	d.ended <- time.Now()
	d.alone("when its ctx ended")
	for end := time.Now().Add(d.drain); time.Now().Before(end); time.Sleep(shPace) {
		if d.l.write(d.h.cli, d.h.id, s) {
			d.drained.Add(1)
		}
	}
	d.alone("at the end of its drain")
}

func (d *shDrainer) alone(when string) {
	if o := d.other.Load(); o != nil && len(o.Owned()) != 0 {
		d.errorf("%s: the other host owns %v", when, o.Owned())
	}
	if got := d.self.Load().Owned(); len(got) != 1 {
		d.errorf("%s: the draining host owns %v", when, got)
	}
}

func TestShardDrain(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	srv, _ := newEtcd(t)
	l := newShLedger()
	const shard = "drained"
	drain := 500 * time.Millisecond * scale
	// b ranks before a: it takes the shard from a when it joins.
	aID, bID := shOrdered(shard, "host-a", "host-b")
	hs := shRegister(t, srv, aID, bID)
	a, b := hs[0], hs[1]
	d := &shDrainer{l: l, h: a, drain: drain, ended: make(chan time.Time, 1), errorf: t.Errorf}
	d.self.Store(a.start(t, l, ShardOptions{Shards: []string{shard}, Run: d.run}).set)
	l.waitEvent(t, 0, SignalShardAcquired, a.id, shard)
	mark := l.mark()
	d.other.Store(b.start(t, l, ShardOptions{Shards: []string{shard}, Run: l.writer(b.cli, b.id)}).set)
	acquired := l.waitEvent(t, mark, SignalShardAcquired, b.id, shard)
	released := l.waitEvent(t, mark, SignalShardReleased, a.id, shard)
	if !errors.Is(released.Err, ErrRebalanced) || errors.Is(released.Err, ErrDraining) {
		t.Fatalf("a released the shard because %v, want ErrRebalanced alone", released.Err)
	}
	gap := acquired.at.Sub(<-d.ended)
	t.Logf("drain %v: a's Run took %v to return, b acquired %v after a's ctx ended (%v after a released), %d writes of a in the drain",
		drain, released.Drain, gap, acquired.at.Sub(released.at), d.drained.Load())
	// Drain is measured from when the shard set saw the ctx end, a
	// moment after Run may have.
	if released.Drain < drain-50*time.Millisecond*scale || released.Drain > drain+200*time.Millisecond*scale {
		t.Fatalf("Drain %v, want %v and a little", released.Drain, drain)
	}
	if gap < drain || acquired.at.Sub(released.at) > 200*time.Millisecond*scale {
		t.Fatalf("handoff %v after a's ctx ended, %v after a released: want the drain %v and a round trip",
			gap, acquired.at.Sub(released.at), drain)
	}
	if d.drained.Load() == 0 {
		t.Fatal("a's Guard did not hold during its drain")
	}
	eventually(t, "b writing", func() bool { _, h := shCheck(l.acked()); return h == 1 })
	if got := a.set.Owned(); len(got) != 0 {
		t.Fatalf("a owns %v after the handoff", got)
	}
	a.set.Close()
	b.set.Close()
	ws := shHistory(t, srv.Client())
	if overlaps, handoffs := shCheck(ws); overlaps != 0 || handoffs != 1 {
		t.Fatalf("%d overlaps, %d handoffs in %d writes; want 0 and 1", overlaps, handoffs, len(ws))
	}
}

func TestShardNoOverlap(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	srv, l, shards, hosts := shFleet(t, 8, 3)
	// One link is slow throughout: that host's writes and renewals
	// arrive late.
	hosts[1].px.Delay(50 * time.Millisecond)
	opts := func(h *shHost) ShardOptions {
		return ShardOptions{Shards: shards, Run: l.writer(h.cli, h.id)}
	}
	for _, h := range hosts {
		h.start(t, l, opts(h))
	}
	shSettle(t, l, shards, hosts, hosts)

	// A join.
	joined := shRegister(t, srv, "host-03")[0]
	hosts = append(hosts, joined.start(t, l, opts(joined)))
	shSettle(t, l, shards, hosts, hosts)
	if len(joined.set.Owned()) == 0 {
		t.Fatal("the join moved no shard")
	}

	// A crash of the host that owns most.
	victim := slices.MaxFunc(hosts, func(a, b *shHost) int { return len(a.set.Owned()) - len(b.set.Owned()) })
	victim.crash()
	rest := slices.DeleteFunc(slices.Clone(hosts), func(h *shHost) bool { return h == victim })
	shSettle(t, l, shards, rest, hosts)

	// A graceful leave of the host that owns most.
	leaver := slices.MaxFunc(rest, func(a, b *shHost) int { return len(a.set.Owned()) - len(b.set.Owned()) })
	leaver.set.Close()
	if err := leaver.live.Stop(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	rest = slices.DeleteFunc(rest, func(h *shHost) bool { return h == leaver })
	shSettle(t, l, shards, rest, hosts)
	for _, h := range hosts {
		h.set.Close()
	}
	ws := shHistory(t, srv.Client())
	overlaps, handoffs := shCheck(ws)
	t.Logf("join, crash, leave: %d fenced writes applied (%d answered), %d handoffs, %d overlaps", len(ws), len(l.acked()), handoffs, overlaps)
	if overlaps != 0 || handoffs < 3 {
		t.Fatalf("%d overlaps, %d handoffs", overlaps, handoffs)
	}
}

func TestShardPartition(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	const shard = "partitioned"
	srv, l, a, b := shRanked(t, shard)
	a.start(t, l, ShardOptions{Shards: []string{shard}, Run: l.writer(a.cli, a.id)})
	l.waitEvent(t, 0, SignalShardAcquired, a.id, shard)
	b.start(t, l, ShardOptions{Shards: []string{shard}, Run: l.writer(b.cli, b.id)})
	etWaitCount(t, srv.Client(), ShardsPrefix+shard+"/", 2, clientv3.WithPrefix())
	l.waitWrites(t, a.id, 0, 5)
	// The owner is cut off; what it sends meanwhile, its writes included,
	// reaches etcd once the link heals.
	mark := l.mark()
	a.px.Pause()
	acquired := l.waitEvent(t, mark, SignalShardAcquired, b.id, shard)
	l.waitWrites(t, b.id, 0, 5)
	released := l.waitEvent(t, mark, SignalShardReleased, a.id, shard)
	// a's Run's ctx ended when a stepped down, Drain before its release:
	// the Run's write in flight over the paused link may outlast b's
	// acquisition (its Guard fences it), the step-down may not.
	if stepped := released.at.Add(-released.Drain); !errors.Is(released.Err, ErrLeadershipLost) || !stepped.Before(acquired.at) {
		t.Fatalf("a stepped down %v before b acquired the shard, because %v; want before, its leadership lost",
			acquired.at.Sub(stepped), released.Err)
	}
	a.px.Unpause()
	// a heals and, better ranked, takes its shard back.
	n := l.writesOf(a.id)
	l.waitEvent(t, mark, SignalShardAcquired, a.id, shard)
	l.waitWrites(t, a.id, n, 5)
	a.set.Close()
	b.set.Close()
	ws := shHistory(t, srv.Client())
	overlaps, handoffs := shCheck(ws)
	t.Logf("partition: a stepped down %v before b took over; %d fenced writes applied (%d answered), %d handoffs, %d overlaps",
		acquired.at.Sub(released.at), len(ws), len(l.acked()), handoffs, overlaps)
	if overlaps != 0 || handoffs < 2 {
		t.Fatalf("%d overlaps, %d handoffs", overlaps, handoffs)
	}
}

func TestShardSet(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("a host not registered owns nothing until it is, and lets go of everything when its registration ends", testShardNotRegistered)
	t.Run("a campaign won while a better-ranked host is in line hands over at once, without Run", testShardHandOverAtOnce)
	t.Run("a better-ranked candidacy ahead of ours in line is no reason to hand over, once our view has caught up with our win; one behind ours is", testShardAheadInLine)
	t.Run("a Run that returns on its own hands the shard over, and queues again after a pause", testShardRunReturns)
	t.Run("a lost leadership ends Run, and the shard is campaigned for again", testShardLeadershipLost)
	t.Run("a broken candidate watch is listed again", testShardBrokenWatch)
	t.Run("the shard sets carry on across an etcd restart", testShardRestart)
	t.Run("an etcd replaced by another cluster, empty: the sets say so, list again, and own every shard again without churn", testShardReplaced)
	t.Run("a standby whose session ends with an etcd reset, its view still of the old one, asks etcd before queueing again and runs the shard on one candidacy", testShardReplacedUnderStandby)
	t.Run("the host watcher finding etcd reset after the set listed it: the set asks etcd, again when refused, and lists nothing again", testShardToldLate)
	t.Run("the host watcher alone finding etcd reset: the set asks etcd, finds its view's etcd replaced, and lists again", testShardToldFirst)
	t.Run("Close ends every Run, waits for them, hands over, and is idempotent", testShardClose)
	t.Run("Close waits for a Run that works on past its ctx's end", testShardCloseWaitsForRun)
	t.Run("Owner reports the owner as etcd holds it; keys that are no candidates are skipped", testShardOwner)
	t.Run("NewShardSet returns within its ctx when etcd cannot be reached, and fails when the hosts may not be read", testShardUnreachable)
	t.Run("bad input is refused and nothing is written", testShardBadInput)
	t.Run("a shard won while our view lags runs only once the view has caught up with the win, and not if our member key was gone then", testShardStaleView)
	t.Run("a shard won at a revision past the last change under the prefix runs, though nothing is written after", testShardWonPastView)
	t.Run("a member whose host is not live takes no slot: the live members own every shard", testShardMemberNotLive)
	t.Run("a member joining takes shards over from a live owner only once no member joined for Settle", testShardSettleHoldsMoves)
	t.Run("a set whose host watcher etcd refuses for good ends, saying why", testShardHostsRefused)
	t.Run("a shard whose owner left is taken at once while members keep joining: Settle holds back planned moves only", testShardFailoverAmidJoins)
	t.Run("a shard whose only candidacy is a leaver's, its member key gone, is a failover: its first-ranked member campaigns at once, the next stands by for it", testShardLeaverCandidacy)
	t.Run("a Host stopped before or while NewShardSet runs makes it fail with ErrHostGone, or the set end with it", testShardHostStopped)
}

// testShardWonPastView: a wins a shard at the revision of a read that
// comes after a write outside the prefix, so its view, at the last change
// under the prefix, is behind the win, and nothing is written after: the
// view must learn from etcd that it has caught up (a progress
// notification). On a stream shared with the shard's monitor, which
// starts past etcd's revision, etcd would send none until the next write.
func testShardWonPastView(t *testing.T) {
	srv, other := newEtcd(t)
	const shard = "s0"
	prefix := ShardsPrefix + shard + "/"
	// Another candidate, first in line, on a lease of its own.
	g, err := other.Grant(testCtx(t), 60)
	if err != nil {
		t.Fatal(err)
	}
	ahead := prefix + hexID(g.ID)
	if _, err := other.Put(testCtx(t), ahead, "host-z", clientv3.WithLease(g.ID)); err != nil {
		t.Fatal(err)
	}
	// Once a's candidate put is answered (behind it), the candidate
	// ahead goes and a key outside the prefix is written: a's read of
	// the line, next, comes after both.
	var once sync.Once
	intercept := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if txn, ok := req.(*pb.TxnRequest); ok && err == nil && puts(txn, prefix) {
			once.Do(func() {
				if _, err := other.Delete(testCtx(t), ahead); err != nil {
					t.Error(err)
				}
				if _, err := other.Put(testCtx(t), "/elsewhere/x", "x"); err != nil {
					t.Error(err)
				}
			})
		}
		return err
	}
	// The win's progress request, if sent before the shard's monitor is
	// registered, is held until it is, as it is when the monitor goes
	// first (its goroutine starts as the leadership is taken).
	monitored := make(chan struct{})
	var monitorOnce sync.Once
	holdProgress := func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		cs, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil {
			return cs, err
		}
		return &progressHold{ClientStream: cs, prefix: prefix, monitored: monitored, once: &monitorOnce}, nil
	}
	cfg := srv.ClientConfig()
	cfg.DialOptions = append(cfg.DialOptions, grpc.WithChainUnaryInterceptor(intercept), grpc.WithChainStreamInterceptor(holdProgress))
	cli, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	register(t, cli, "host-a", LivenessOptions{TTL: time.Second * scale})
	l := newShLedger()
	tap, log := newLogTap()
	tap.dumpOnFailure(t)
	a := shSet(t, cli, "host-a", l, ShardOptions{Shards: []string{shard}, Logger: log})
	l.until(t, "a owning the shard", func() bool { return len(a.Owned()) == 1 })
	if tap.count("coord: shard won, waiting for our view to catch up") == 0 {
		t.Fatal("a's view was not behind its win: the test did not set up what it tests")
	}
}

// progressHold is a watch stream whose progress requests wait, held,
// until a watch of one key under prefix from a given revision (a
// candidacy's monitor) has been asked for, on any stream; the request
// held goes with the stream's next message.
type progressHold struct {
	grpc.ClientStream
	prefix    string
	monitored chan struct{}
	once      *sync.Once
	held      bool
}

func (h *progressHold) SendMsg(m any) error {
	wr, ok := m.(*pb.WatchRequest)
	if !ok {
		return h.ClientStream.SendMsg(m)
	}
	if wr.GetProgressRequest() != nil && !isClosed(h.monitored) {
		h.held = true
		return nil
	}
	err := h.ClientStream.SendMsg(m)
	if c := wr.GetCreateRequest(); c != nil && strings.HasPrefix(string(c.Key), h.prefix) && len(c.RangeEnd) == 0 && c.StartRevision > 0 {
		h.once.Do(func() { close(h.monitored) })
	}
	if h.held && isClosed(h.monitored) && err == nil {
		h.held = false
		err = h.ClientStream.SendMsg(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_ProgressRequest{ProgressRequest: &pb.WatchProgressRequest{}}})
	}
	return err
}

// testShardStaleView: b's view of the members and candidates lags (as
// after a quorum loss, when the watches list again) while its member key
// is deleted and it wins a campaign: it must not run the shard on the
// view that still shows it a member.
func testShardStaleView(t *testing.T) {
	srv, cli := newEtcd(t)
	l := newShLedger()
	shard := shRankedAs("host-a", "host-b")
	hs := shRegister(t, srv, "host-a", "host-b")
	a, b := hs[0], hs[1]
	opts := ShardOptions{Shards: []string{shard}}
	a.start(t, l, opts)
	l.waitEvent(t, 0, SignalShardAcquired, a.id, shard)
	bcli, lag := shLagClient(t, srv.ClientConfig())
	tap, log := newLogTap()
	tap.dumpOnFailure(t)
	bOpts := opts
	bOpts.Logger = log
	b.set = shSet(t, bcli, b.id, l, bOpts)
	tap.wait(t, "coord: campaign waits for its turn", 1)

	lag.hold()
	defer lag.release()
	del, err := cli.Delete(testCtx(t), memberKey(ShardsPrefix, b.id))
	if err != nil || del.Deleted != 1 {
		t.Fatalf("delete b's member key: %v, %v", del, err)
	}
	mark := l.mark()
	a.set.Close()
	// b wins; it decides at once (on the view that lags), or waits for
	// its view: only then is the view let go.
	const acquired, handedOver, waits = "coord: shard acquired", "coord: shard won, handed over at once", "coord: shard won, waiting for our view to catch up"
	eventually(t, "b deciding on its won campaign, or waiting for its view", func() bool {
		return tap.count(acquired)+tap.count(handedOver)+tap.count(waits) > 0
	})
	lag.release()
	l.until(t, "b owning the shard again", func() bool { return l.held()[[2]string{b.id, shard}] })
	for _, ev := range l.since(mark, SignalShardAcquired) {
		if ev.Host == b.id && ev.Token < del.Header.Revision {
			t.Fatalf("b ran the shard with token %d, a candidacy put before its member key was deleted (at %d): on a stale view", ev.Token, del.Header.Revision)
		}
	}
}

// testShardMemberNotLive: b runs a set (its member key is there) but is
// not registered: a ranks it nowhere, and owns every shard.
func testShardMemberNotLive(t *testing.T) {
	srv, cli := newEtcd(t)
	l := newShLedger()
	shards := shNames(8)
	a := shRegister(t, srv, "host-a")[0]
	// One candidate a shard: a shard that ranked b first would be no
	// one's.
	opts := ShardOptions{Shards: shards, Replicas: 1}
	shSet(t, srv.NewClient(t), "host-b", l, opts)
	etWaitCount(t, cli, memberKey(ShardsPrefix, "host-b"), 1)
	a.start(t, l, opts)
	l.until(t, "a owning every shard", func() bool { return len(a.set.Owned()) == len(shards) })
}

// testShardSettleHoldsMoves: c joins a fleet whose shards a owns; it
// campaigns for those it ranks first only once Settle has passed since
// the last join (its own).
func testShardSettleHoldsMoves(t *testing.T) {
	srv, _ := newEtcd(t)
	l := newShLedger()
	shards := shNames(8)
	hs := shRegister(t, srv, "host-a", "host-c")
	a, c := hs[0], hs[1]
	settle := time.Second * scale
	opts := ShardOptions{Shards: shards, Replicas: 1, Settle: settle}
	a.start(t, l, opts)
	l.until(t, "a owning every shard", func() bool { return len(a.set.Owned()) == len(shards) })
	mark := l.mark()
	joined := time.Now()
	c.start(t, l, opts)
	var first shEvent
	l.until(t, "c taking a shard over", func() bool {
		evs := slices.DeleteFunc(l.since(mark, SignalShardAcquired), func(ev shEvent) bool { return ev.Host != c.id })
		if len(evs) > 0 {
			first = evs[0]
		}
		return len(evs) > 0
	})
	if took := first.at.Sub(joined); took < settle {
		t.Fatalf("c took %s over %v after joining, before Settle (%v)", first.Shard, took, settle)
	}
}

// testShardHostsRefused: the set's user loses the right to read the
// hosts; etcd restarts, and the host watcher's listing is refused: the
// set ends (Done, Err), it does not run blind.
func testShardHostsRefused(t *testing.T) {
	srv, _ := newEtcd(t)
	login := enableAuth(t, srv, map[string][]keyRange{"member": {prefixRange(ShardsPrefix), prefixRange(HostsPrefix)}})
	root := login("root")
	register(t, root, "x", LivenessOptions{TTL: 5 * time.Second * scale})
	l := newShLedger()
	s := shSet(t, login("member"), "x", l, ShardOptions{Shards: shNames(2), TTL: 5 * time.Second * scale})
	l.until(t, "x owning every shard", func() bool { return len(s.Owned()) == 2 })
	must := mustOK(t)
	must(root.RoleRevokePermission(testCtx(t), "member", HostsPrefix, clientv3.GetPrefixRangeEnd(HostsPrefix)))
	srv.Restart()
	waitClosed(t, s.Done(), "the set's end")
	if !errors.Is(s.Err(), rpctypes.ErrPermissionDenied) || len(s.Owned()) != 0 {
		t.Fatalf("the set ended with %v, owning %v; want permission denied, nothing", s.Err(), s.Owned())
	}
}

// testShardFailoverAmidJoins: a flapping member (a fast rolling deploy)
// joins again and again, each join within Settle of the last; the owner
// of a shard leaves; the next member takes it over while the joins go
// on.
func testShardFailoverAmidJoins(t *testing.T) {
	srv, _ := newEtcd(t)
	l := newShLedger()
	hosts := []string{"host-a", "host-b", "host-c"}
	shard := shRankedAs(hosts...)
	hs := shRegister(t, srv, hosts...)
	a, b, c := hs[0], hs[1], hs[2]
	opts := ShardOptions{Shards: []string{shard}, Replicas: 1, Settle: 2 * time.Second * scale}
	a.start(t, l, opts)
	b.start(t, l, opts)
	l.waitEvent(t, 0, SignalShardAcquired, a.id, shard)

	// c, ranked last, joins and leaves until b owns the shard.
	owned := make(chan struct{})
	var joins atomic.Int32
	flapped := make(chan struct{})
	go func() {
		defer close(flapped)
		o := opts
		o.Self, o.Run = c.id, idle
		for !isClosed(owned) {
			s, err := NewShardSet(testCtx(t), c.cli, o)
			if err != nil {
				return
			}
			joins.Add(1)
			s.Close()
			if !sleep(t.Context(), 100*time.Millisecond) { // pacing
				return
			}
		}
	}()
	eventually(t, "c joining twice", func() bool { return joins.Load() >= 2 })
	mark := l.mark()
	a.set.Close()
	// With the joins holding it back for Settle each, b would own the
	// shard only once they stop: at the deadline.
	l.until(t, "b owning the shard while c keeps joining", func() bool { return l.held()[[2]string{b.id, shard}] })
	close(owned)
	<-flapped
	if evs := l.since(mark, SignalShardAcquired); len(evs) != 1 {
		t.Fatalf("acquired since a left: %v, want b's only", evs)
	}
}

// testShardLeaverCandidacy: a, which owned a shard, is leaving: its
// member key is gone, its candidacy still stands (a closing set's member
// key may go first). b ranks first now, c next; both joined within
// Settle, b's far longer than c's. b must not wait for joins to settle (a
// failover), and c must not go ahead of b in line (it would own the shard
// only to hand it to b): the shard goes from a to b, and to b only.
func testShardLeaverCandidacy(t *testing.T) {
	srv, cli := newEtcd(t)
	l := newShLedger()
	shard := shRankedAs("host-a", "host-b", "host-c")
	prefix := ShardsPrefix + shard + "/"
	g, err := cli.Grant(testCtx(t), 60)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(testCtx(t), prefix+hexID(g.ID), "host-a", clientv3.WithLease(g.ID)); err != nil {
		t.Fatal(err)
	}
	hs := shRegister(t, srv, "host-b", "host-c")
	b, c := hs[0], hs[1]
	tap, tlog := newLogTap()
	tap.dumpOnFailure(t)
	// b's Settle outlasts the test's waits.
	opts := ShardOptions{Shards: []string{shard}, Settle: 2 * patience(), Logger: tlog.With("host", b.id)}
	b.start(t, l, opts)
	opts.Settle, opts.Logger = 100*time.Millisecond*scale, tlog.With("host", c.id)
	c.start(t, l, opts)
	etWaitCount(t, cli, prefix, 3, clientv3.WithPrefix())
	var line []string
	for _, kv := range candidates(t, cli, prefix) {
		line = append(line, string(kv.Value))
	}
	if !slices.Equal(line, []string{"host-a", "host-b", "host-c"}) {
		t.Fatalf("in line: %v, want host-a, host-b, host-c", line)
	}
	mark := l.mark()
	if _, err := cli.Revoke(testCtx(t), g.ID); err != nil {
		t.Fatal(err)
	}
	l.waitEvent(t, mark, SignalShardAcquired, b.id, shard)
	if evs := l.since(mark, SignalShardAcquired); len(evs) != 1 {
		t.Fatalf("acquired since a's candidacy went: %v, want b's only", evs)
	}
}

// testShardHostStopped: a Host whose registration ends before or during
// NewShardSet. Under -race this is where the set's start and its end
// would meet (20 times, stopping the host at once and after a moment).
func testShardHostStopped(t *testing.T) {
	srv, _ := newEtcd(t)
	cli := srv.NewClient(t)
	opts := ShardOptions{Shards: shNames(4), Run: idle, TTL: 2 * time.Second * scale}
	h := register(t, cli, "stopped", LivenessOptions{})
	h.Stop(testCtx(t))
	opts.Host = h
	if s, err := NewShardSet(testCtx(t), cli, opts); s != nil || !errors.Is(err, ErrHostGone) || strings.Count(err.Error(), "coord:") != 1 {
		t.Fatalf("NewShardSet with a stopped Host: %v, %v; want ErrHostGone, saying \"coord:\" once", s, err)
	}
	for i := range 20 {
		h := register(t, cli, fmt.Sprintf("h%d", i), LivenessOptions{})
		opts.Host = h
		stopped := make(chan struct{})
		go func() {
			defer close(stopped)
			if i%2 == 1 {
				runtime.Gosched()
			}
			h.Stop(testCtx(t))
		}()
		s, err := NewShardSet(testCtx(t), cli, opts)
		<-stopped
		switch {
		case err != nil && !errors.Is(err, ErrHostGone):
			t.Fatalf("try %d: NewShardSet while its Host stops: %v, want nil or ErrHostGone", i, err)
		case err == nil:
			waitClosed(t, s.Done(), "the set's end after its Host stopped")
			if !errors.Is(s.Err(), ErrHostGone) || len(s.Owned()) != 0 {
				t.Fatalf("try %d: the set ended with %v, owning %v; want ErrHostGone, nothing", i, s.Err(), s.Owned())
			}
		}
	}
}

func testShardNotRegistered(t *testing.T) {
	srv, cli := newEtcd(t)
	l := newShLedger()
	shards := shNames(4)
	s := shSet(t, cli, "x", l, ShardOptions{Shards: shards})
	s.mu.Lock()
	n := len(s.workers)
	s.mu.Unlock()
	// Our member key is all we wrote.
	if n != 0 || len(s.Owned()) != 0 || keyCount(t, cli, ShardsPrefix) != 1 || keyCount(t, cli, memberKey(ShardsPrefix, "x")) != 1 {
		t.Fatalf("%d workers, owned %v, %d keys before x is registered, want only its member key", n, s.Owned(), keyCount(t, cli, ShardsPrefix))
	}
	x := shRegister(t, srv, "x")[0]
	l.until(t, "x owning every shard", func() bool { return len(s.Owned()) == len(shards) })
	mark := l.mark()
	if err := x.live.Stop(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	l.until(t, "every shard released", func() bool { return len(l.since(mark, SignalShardReleased)) == len(shards) })
	for _, ev := range l.since(mark, SignalShardReleased) {
		if !errors.Is(ev.Err, ErrHostGone) {
			t.Fatalf("released %s because %v, want ErrHostGone", ev.Shard, ev.Err)
		}
	}
	etWaitCount(t, cli, ShardsPrefix, 1, clientv3.WithPrefix()) // the member key
	if len(s.Owned()) != 0 {
		t.Fatalf("owns %v while not live", s.Owned())
	}
}

func testShardHandOverAtOnce(t *testing.T) {
	srv, cli := newEtcd(t)
	l := newShLedger()
	const shard = "contested"
	uID, bID := shOrdered(shard, "host-u", "host-b")
	hs := shRegister(t, srv, uID, bID)
	u, b := hs[0], hs[1]
	// Someone else leads: both hosts wait in line, u first.
	other := etElection(t, srv.NewClient(t), ElectionOptions{Key: ShardsPrefix + shard})
	etCampaign(t, other, "not-a-host")
	tap, log := newLogTap()
	u.start(t, l, ShardOptions{Shards: []string{shard}, Logger: log})
	etWaitCount(t, cli, ShardsPrefix+shard+"/", 2, clientv3.WithPrefix())
	b.start(t, l, ShardOptions{Shards: []string{shard}})
	etWaitCount(t, cli, ShardsPrefix+shard+"/", 3, clientv3.WithPrefix())
	if err := other.Resign(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	l.waitEvent(t, 0, SignalShardAcquired, b.id, shard)
	tap.wait(t, "coord: shard won, handed over at once", 1)
	if evs := l.since(0, SignalShardAcquired); len(evs) != 1 {
		t.Fatalf("acquired: %v, want b's only", evs)
	}
	// u queues again behind b.
	etWaitCount(t, cli, ShardsPrefix+shard+"/", 2, clientv3.WithPrefix())
	if owner, err := b.set.Owner(testCtx(t), shard); err != nil || owner != b.id {
		t.Fatalf("Owner = %q, %v; want %s", owner, err, b.id)
	}
}

// shLag holds back what etcd sends on a client's watches that require a
// leader, as a slow watch stream would: a ShardSet follows the hosts and
// the candidates on those, while its campaigns wait for their turn on
// others.
type shLag struct {
	mu   sync.Mutex
	held chan struct{} // closed by release; nil while nothing is held
}

// hold holds back, from now on, what the watches receive.
func (l *shLag) hold() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held == nil {
		l.held = make(chan struct{})
	}
}

// release hands over what was held back, and lets the rest through.
func (l *shLag) release() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held != nil {
		close(l.held)
		l.held = nil
	}
}

func (l *shLag) gate() chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.held
}

// shLagClient returns a client made from cfg whose watches that require
// a leader lag while held (see shLag). It is closed at the end of the
// test.
func shLagClient(t *testing.T, cfg clientv3.Config) (*clientv3.Client, *shLag) {
	t.Helper()
	lag := &shLag{}
	cfg.DialOptions = append(slices.Clone(cfg.DialOptions), grpc.WithChainStreamInterceptor(
		func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			s, err := streamer(ctx, desc, cc, method, opts...)
			md, _ := metadata.FromOutgoingContext(ctx)
			if err != nil || method != "/etcdserverpb.Watch/Watch" || len(md.Get(rpctypes.MetadataRequireLeaderKey)) == 0 {
				return s, err
			}
			return &shLagStream{ClientStream: s, lag: lag}, nil
		}))
	c, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	t.Cleanup(lag.release)
	return c, lag
}

type shLagStream struct {
	grpc.ClientStream
	lag   *shLag
	once  sync.Once
	in    chan shRecvd        // what etcd sent, in order, read ahead
	stash []*pb.WatchResponse // held back, in order
}

type shRecvd struct {
	wr  *pb.WatchResponse
	err error
}

// RecvMsg returns what etcd sent, holding back, while held, what the
// set's views receive: the events of its campaigns' watches (deletes
// with the key they took, PrevKv) go past them, as they would on a
// stream of their own.
func (s *shLagStream) RecvMsg(m any) error {
	s.once.Do(func() {
		s.in = make(chan shRecvd)
		go s.read()
	})
	for {
		held := s.lag.gate()
		if held == nil && len(s.stash) > 0 {
			proto.Reset(m.(proto.Message))
			proto.Merge(m.(proto.Message), s.stash[0])
			s.stash = s.stash[1:]
			return nil
		}
		select {
		case r := <-s.in:
			if r.err != nil {
				return r.err
			}
			held = s.lag.gate() // as it is now, not as it was before the wait
			// A view's events are held, and what follows them on the
			// stream, but for the creation of a watch (a campaign waits
			// for it): a progress notification must not overtake them.
			if held != nil && (len(r.wr.Events) > 0 && r.wr.Events[0].PrevKv == nil || len(s.stash) > 0 && len(r.wr.Events) == 0 && !r.wr.Created) {
				s.stash = append(s.stash, r.wr)
				continue
			}
			proto.Reset(m.(proto.Message))
			proto.Merge(m.(proto.Message), r.wr)
			return nil
		case <-held:
		case <-s.Context().Done():
			return s.Context().Err()
		}
	}
}

// read reads ahead what etcd sends, until the stream ends.
func (s *shLagStream) read() {
	for {
		wr := new(pb.WatchResponse)
		err := s.ClientStream.RecvMsg(wr)
		select {
		case s.in <- shRecvd{wr, err}:
		case <-s.Context().Done():
			return
		}
		if err != nil {
			return
		}
	}
}

// testShardAheadInLine: once we lead, those ahead of us in line are gone;
// we decide on a view that has caught up with our win, and only a
// better-ranked candidacy behind ours is a reason to hand over.
func testShardAheadInLine(t *testing.T) {
	srv, cli := newEtcd(t)
	l := newShLedger()
	const shard = "ahead"
	prefix := ShardsPrefix + shard + "/"
	worse, better := shOrdered(shard, "host-a", "host-b")
	hs := shRegister(t, srv, better, worse)
	x, y := hs[0], hs[1]
	opts := ShardOptions{Shards: []string{shard}}
	x.start(t, l, opts)
	l.waitEvent(t, 0, SignalShardAcquired, x.id, shard)
	// y, worse ranked, queues behind x, which it lists among the
	// candidates.
	ycli, lag := shLagClient(t, srv.ClientConfig())
	tap, log := newLogTap()
	tap.dumpOnFailure(t)
	y.set = shSet(t, ycli, y.id, l, ShardOptions{Shards: []string{shard}, Logger: log})
	etWaitCount(t, cli, prefix, 2, clientv3.WithPrefix())

	// x withdraws (it stays live, better ranked) while y's view lags: y
	// leads, and decides only once its view has caught up with its win.
	mark := l.mark()
	lag.hold()
	defer lag.release()
	x.set.Close()
	const acquired, handedOver = "coord: shard acquired", "coord: shard won, handed over at once"
	tap.wait(t, "coord: leadership gained", 1)
	if n := tap.count(acquired) + tap.count(handedOver); n != 0 {
		t.Fatalf("y decided on its won campaign (%d×) on a view behind its win", n)
	}
	lag.release()
	eventually(t, "y deciding on its won campaign", func() bool { return tap.count(acquired)+tap.count(handedOver) > 0 })
	if n := tap.count(handedOver); n != 0 {
		t.Fatalf("y handed the shard over at once (%d×), for a candidacy that was ahead of its own", n)
	}
	won := l.waitEvent(t, mark, SignalShardAcquired, y.id, shard)
	if got := y.set.Owned(); len(got) != 1 || got[0].Token != won.Token {
		t.Fatalf("y owns %v, want %s with token %d", got, shard, won.Token)
	}

	// x campaigns again, behind y: y hands over.
	x.start(t, l, opts)
	rel := l.waitEvent(t, mark, SignalShardReleased, y.id, shard)
	if !errors.Is(rel.Err, errBetterHost) || rel.Token != won.Token {
		t.Fatalf("y released token %d because %v; want token %d, errBetterHost", rel.Token, rel.Err, won.Token)
	}
	l.waitEvent(t, mark, SignalShardAcquired, x.id, shard)
	var seq []string
	for _, ev := range l.since(mark, SignalShardAcquired) {
		seq = append(seq, ev.Host)
	}
	if !slices.Equal(seq, []string{y.id, x.id}) {
		t.Fatalf("acquired by %v; want %s once, then %s", seq, y.id, x.id)
	}
}

func testShardRunReturns(t *testing.T) {
	const shard = "flaky"
	_, l, a, b := shRanked(t, shard)
	var calls atomic.Int32
	tap, log := newLogTap()
	b.start(t, l, ShardOptions{Shards: []string{shard}})
	l.waitEvent(t, 0, SignalShardAcquired, b.id, shard)
	a.start(t, l, ShardOptions{Shards: []string{shard}, Logger: log, Run: func(ctx context.Context, s Shard) {
		if calls.Add(1) > 1 {
			<-ctx.Done()
		}
	}})
	// b hands over to a, whose first Run returns at once: back to b,
	// then to a again once it queues again.
	eventually(t, "a's second Run", func() bool { return calls.Load() == 2 })
	if got := a.set.Owned(); len(got) != 1 {
		t.Fatalf("a owns %v", got)
	}
	tap.wait(t, "coord: shard queues again after a pause", 1)
	var seq []string
	for _, ev := range l.since(0, SignalShardAcquired) {
		seq = append(seq, ev.Host)
	}
	// b owns the shard between a's Runs unless a queued again
	// before b got to it (b then hands over at once).
	if !slices.Equal(seq, []string{b.id, a.id, b.id, a.id}) && !slices.Equal(seq, []string{b.id, a.id, a.id}) {
		t.Fatalf("owners %v, want %s then %s, twice", seq, b.id, a.id)
	}
	if rel := l.waitEvent(t, 0, SignalShardReleased, a.id, shard); rel.Err != nil || rel.Drain > 100*time.Millisecond*scale {
		t.Fatalf("a's first Run released %+v, want no error and no drain", rel)
	}
}

func testShardLeadershipLost(t *testing.T) {
	srv, cli := newEtcd(t)
	l := newShLedger()
	a := shRegister(t, srv, "a")[0].start(t, l, ShardOptions{Shards: []string{"s"}})
	first := l.waitEvent(t, 0, SignalShardAcquired, "a", "s")
	etRevoke(t, cli, clientv3.LeaseID(candidates(t, cli, ShardsPrefix+"s/")[0].Lease))
	rel := l.waitEvent(t, 0, SignalShardReleased, "a", "s")
	if !errors.Is(rel.Err, ErrLeadershipLost) {
		t.Fatalf("released because %v, want ErrLeadershipLost", rel.Err)
	}
	l.until(t, "a acquiring again", func() bool { return len(l.since(0, SignalShardAcquired)) == 2 })
	again := l.since(0, SignalShardAcquired)[1]
	if again.Token <= first.Token || len(a.set.Owned()) != 1 || a.set.Owned()[0].Token != again.Token {
		t.Fatalf("tokens %d then %d, owned %v", first.Token, again.Token, a.set.Owned())
	}
}

func testShardBrokenWatch(t *testing.T) {
	srv, cli := newEtcd(t)
	l := newShLedger()
	const shard = "cut"
	aID, bID := shOrdered(shard, "host-a", "host-b")
	px := srv.NewProxy(t)
	a := &shHost{id: aID, cli: px.NewClient(t)}
	a.live = register(t, cli, aID, LivenessOptions{TTL: 3 * time.Second * scale})
	// The sessions must outlast the cut: a TTL scaled long enough.
	a.start(t, l, ShardOptions{Shards: []string{shard}, TTL: 3 * time.Second * scale})
	l.waitEvent(t, 0, SignalShardAcquired, aID, shard)
	// While a is cut off, b joins and queues; the events are compacted
	// away before a's connections are reset, so a's watches break.
	px.Blackhole()
	b := shRegister(t, srv, bID)[0].start(t, l, ShardOptions{Shards: []string{shard}})
	etWaitCount(t, cli, ShardsPrefix+shard+"/", 2, clientv3.WithPrefix())
	for range 2 {
		if _, err := cli.Put(testCtx(t), "/test/other", "x"); err != nil {
			t.Fatal(err)
		}
	}
	srv.Compact(testCtx(t))
	px.Unblackhole()
	l.waitEvent(t, 0, SignalShardAcquired, b.id, shard)
	if rel := l.waitEvent(t, 0, SignalShardReleased, aID, shard); !errors.Is(rel.Err, errBetterHost) {
		t.Fatalf("a released because %v, want errBetterHost", rel.Err)
	}
}

func testShardRestart(t *testing.T) {
	srv, l, shards, hosts := shFleet(t, 8, 2)
	// The sessions outlast the restart.
	shStartAll(t, l, hosts, ShardOptions{Shards: shards, TTL: 3 * time.Second * scale})
	srv.Restart()
	hosts = append(hosts, shRegister(t, srv, "host-02")[0].start(t, l, ShardOptions{Shards: shards}))
	shSettle(t, l, shards, hosts, hosts)
}

// testShardReplaced replaces etcd under two members by another cluster,
// empty: the sets say so, unhealthy until they listed again, and own every
// shard again without churn.
func testShardReplaced(t *testing.T) {
	srv, l, shards, hosts := shFleet(t, 8, 2)
	tap, tlog := newLogTap()
	tap.dumpOnFailure(t)
	var (
		mu sync.Mutex
		// what each set's Healthy said when it (Key ShardsPrefix), or its
		// host watcher (Key HostsPrefix), said etcd was replaced
		health = map[[2]string]error{}
	)
	for _, h := range hosts {
		var set atomic.Pointer[ShardSet]
		h.set = shSet(t, h.cli, h.id, l, ShardOptions{Shards: shards, Logger: tlog.With("host", h.id), OnSignal: func(sig Signal) {
			l.hook(sig)
			if sig.Kind == SignalEtcdReplaced {
				mu.Lock()
				defer mu.Unlock()
				health[[2]string{h.id, sig.Key}] = set.Load().Healthy()
			}
		}})
		set.Store(h.set)
	}
	shSettle(t, l, shards, hosts, hosts)
	// The old etcd's revisions far ahead of where the new one gets in
	// the test: the views' watches, resumed on it, would wait for good.
	for range 300 {
		wtPut(t, srv.Client(), "/elsewhere/", meta("x"), 0)
	}
	mark := l.mark()
	srv.Replace()
	start := time.Now()
	l.until(t, "every shard acquired again", func() bool {
		again := map[string]bool{}
		for _, ev := range l.since(mark, SignalShardAcquired) {
			again[ev.Shard] = true
		}
		return len(again) == len(shards)
	})
	shSettle(t, l, shards, hosts, hosts)
	t.Logf("every shard owned again %v after etcd was replaced", time.Since(start).Round(time.Millisecond))
	// Replicas 2: each shard's owner and standby, two candidacies when
	// nothing is wasted, and the goal is fewer than three. The sets find
	// the replacement each its own way and list the new etcd each after
	// its own pause; their members and hosts come back as each finds its
	// leases gone. Nothing is put before a set has listed the new etcd (a
	// leadership that ended and a campaign that queues again ask etcd
	// first), and the members of the old view are awaited meanwhile: the
	// first member back takes no shard from a better-ranked one, and lets
	// none go while its own registration heals.
	puts := shCandidacies(t, srv.Client())
	t.Logf("candidacies put on the new etcd, by shard: %v", puts)
	// Each listing again is for a word of the replacement that the set
	// had not taken in yet: answers of the new etcd keep telling until a
	// listing has, and none of those words may have it list again (each
	// listing also lets a won shard run on a view forgotten just after).
	for _, r := range tap.records("coord: shard set: candidate watch broke, listing again") {
		r.Attrs(func(a slog.Attr) bool {
			if err, _ := a.Value.Any().(error); a.Key == "err" && !errors.Is(err, errEtcdReplaced) {
				t.Errorf("a set listed again for %v, not for etcd replaced", err)
			}
			return true
		})
	}
	for _, sh := range shards {
		if puts[sh] > 2 {
			t.Errorf("%d candidacies put for %s on the new etcd, want at most 2", puts[sh], sh)
		}
	}
	told := func(host, key string) (error, bool) {
		mu.Lock()
		defer mu.Unlock()
		err, ok := health[[2]string{host, key}]
		return err, ok
	}
	for _, h := range hosts {
		for _, key := range []string{HostsPrefix, ShardsPrefix} {
			eventually(t, fmt.Sprintf("%s told by %s that etcd was replaced", h.id, key), func() bool {
				_, ok := told(h.id, key)
				return ok
			})
			if err, _ := told(h.id, key); err == nil || !strings.Contains(err.Error(), "etcd replaced") {
				t.Fatalf("%s: Healthy when %s said etcd was replaced: %v, want an error saying so", h.id, key, err)
			}
		}
		eventually(t, h.id+" healthy again", func() bool { return h.set.Healthy() == nil })
	}
}

// testShardReplacedUnderStandby resets etcd under a standby, b, whose
// view holds the old etcd's candidacy of the owner, a, at a revision the
// new etcd does not reach in the test. a is cut off; b's reads of the
// hosts and the puts of its member key are held: neither its host watcher
// nor its member key tells b. b's session is gone with the old etcd: its
// campaign, queueing again, asks etcd first, finds it replaced, and is
// held until b has listed the new etcd. (Queued at once, it would win
// there while its view says that a, better ranked, is in line behind it:
// a view believed would have b hand over to nobody and win again, over
// and over, until its token passed a's old revision.) Once its member key
// is put, b runs the shard on a single candidacy.
func testShardReplacedUnderStandby(t *testing.T) {
	srv, _ := newEtcd(t)
	l := newShLedger()
	shard := shRankedAs("host-a", "host-b")
	for range 300 {
		wtPut(t, srv.Client(), "/elsewhere/", meta("x"), 0)
	}
	a := shRegister(t, srv, "host-a")[0]
	memberB := memberKey(ShardsPrefix, "host-b")
	hold := newReqHold(func(req any) bool {
		switch r := req.(type) {
		case *pb.RangeRequest:
			return strings.HasPrefix(string(r.Key), HostsPrefix)
		case *pb.PutRequest:
			return string(r.Key) == memberB
		}
		return false
	})
	defer hold.release() // before the cleanups: b's set and client close
	b := &shHost{id: "host-b", cli: hold.client(t, srv.ClientConfig())}
	b.live = register(t, b.cli, b.id, LivenessOptions{TTL: time.Second * scale})
	tap, tlog := newLogTap()
	tap.dumpOnFailure(t)
	var told atomic.Pointer[Signal]
	a.start(t, l, ShardOptions{Shards: []string{shard}})
	b.start(t, l, ShardOptions{Shards: []string{shard}, Logger: tlog, OnSignal: func(sig Signal) {
		l.hook(sig)
		if sig.Kind == SignalEtcdReplaced && sig.Key == ShardsPrefix {
			told.CompareAndSwap(nil, &sig)
		}
	}})
	shSettle(t, l, []string{shard}, []*shHost{a, b}, []*shHost{a, b})
	shSettleCandidates(t, srv.Client(), []string{shard}, []*shHost{a, b}, 2)
	hold.start()
	a.px.Blackhole()
	mark := l.mark()
	srv.Reset()
	eventually(t, "b saying etcd was replaced", func() bool { return told.Load() != nil })
	if sig := told.Load(); sig.Host != b.id || !errors.Is(sig.Err, errEtcdReplaced) {
		t.Fatalf("signal %+v, want one of b's set saying etcd was replaced", sig)
	}
	hold.release()
	ev := l.waitEvent(t, mark, SignalShardAcquired, b.id, shard)
	if puts := shCandidacies(t, srv.Client()); puts[shard] != 1 {
		t.Fatalf("%d candidacies put for %s on the new etcd, want b's alone", puts[shard], shard)
	}
	t.Logf("b acquired %s on the new etcd with token %d", shard, ev.Token)
}

// testShardToldLate resets etcd under a set whose host watcher's reads
// are held until the set has found the reset itself and listed the new
// etcd: the watcher's word comes after. The set asks etcd whether the etcd
// of its view was replaced; the first ask is refused, and asked again. Its
// answer says no: taken for a word of an etcd not listed yet, the word
// would have the set list again, and each standby queued on the new etcd
// go through the rules again (put again).
func testShardToldLate(t *testing.T) {
	srv, l, a := shToldHost(t)
	hold := newReqHold(func(req any) bool {
		r, ok := req.(*pb.RangeRequest)
		return ok && strings.HasPrefix(string(r.Key), HostsPrefix)
	})
	defer hold.release() // before the cleanups: the set and the clients close
	var (
		armed atomic.Bool  // once the set has listed the new etcd
		asks  atomic.Int32 // asked after
	)
	cli := interceptedClient(t, srv.ClientConfig(), func(ctx context.Context, method string, req, reply any,
		cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if r, ok := req.(*pb.RangeRequest); ok && r.CountOnly && string(r.Key) == ShardsPrefix && armed.Load() && asks.Add(1) == 1 {
			return errors.New("test: the first ask refused")
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
	tap, tlog := newLogTap()
	tap.dumpOnFailure(t)
	shard := "shard-0"
	a.set = shSet(t, cli, a.id, l, ShardOptions{Shards: []string{shard}, Logger: tlog, WatchClient: hold.client(t, srv.ClientConfig())})
	shSettle(t, l, []string{shard}, []*shHost{a}, []*shHost{a})
	hold.start()
	mark := l.mark()
	srv.Reset()
	l.waitEvent(t, mark, SignalShardAcquired, a.id, shard)
	tap.wait(t, "coord: shard set: etcd was replaced or restored, listing the members and candidates again", 1)
	// The leadership that ended with the old etcd asked before, and may
	// have found the new one listed already.
	const no = "coord: shard set: etcd asked whether it was replaced: it was not"
	before := tap.count(no)
	armed.Store(true)
	hold.release()
	tap.wait(t, "coord: etcd was replaced or restored, listing the hosts again", 1)
	tap.wait(t, no, before+1)
	if n := asks.Load(); n != 2 {
		t.Fatalf("the set asked etcd %d times whether it was replaced after the watcher's word, want 2 (the first refused)", n)
	}
	if n := tap.count("coord: shard set: candidate watch broke, listing again"); n != 1 {
		t.Fatalf("the set listed again %d times, want once, for the reset", n)
	}
	if puts := shCandidacies(t, srv.Client()); puts[shard] != 1 {
		t.Fatalf("%d candidacies put for %s on the new etcd, want 1", puts[shard], shard)
	}
}

// testShardToldFirst resets etcd under a set whose own requests that
// would find the reset are held (its writes under the prefix, its reads of
// a shard's candidates): its host watcher alone finds it. The set asks
// etcd, finds the etcd of its view replaced, and lists again, before any
// of those requests is answered; then owns the shard on the new etcd.
func testShardToldFirst(t *testing.T) {
	srv, l, a := shToldHost(t)
	hold := newReqHold(func(req any) bool {
		switch r := req.(type) {
		case *pb.RangeRequest:
			return strings.HasPrefix(string(r.Key), ShardsPrefix) && string(r.Key) != ShardsPrefix
		case *pb.PutRequest:
			return strings.HasPrefix(string(r.Key), ShardsPrefix)
		case *pb.TxnRequest:
			return slices.ContainsFunc(r.Success, func(op *pb.RequestOp) bool {
				p := op.GetRequestPut()
				return p != nil && strings.HasPrefix(string(p.Key), ShardsPrefix)
			})
		}
		return false
	})
	defer hold.release() // before the cleanups: the set and its client close
	tap, tlog := newLogTap()
	tap.dumpOnFailure(t)
	shard := "shard-0"
	a.set = shSet(t, hold.client(t, srv.ClientConfig()), a.id, l, ShardOptions{Shards: []string{shard}, Logger: tlog})
	shSettle(t, l, []string{shard}, []*shHost{a}, []*shHost{a})
	hold.start()
	mark := l.mark()
	srv.Reset()
	tap.wait(t, "coord: etcd was replaced or restored, listing the hosts again", 1)
	tap.wait(t, "coord: shard set: etcd was replaced or restored, listing the members and candidates again", 1)
	hold.release()
	l.waitEvent(t, mark, SignalShardAcquired, a.id, shard)
}

// shToldHost starts an etcd whose revisions are far ahead of where a new
// one gets in a test (a watch resumed on it is silent), with a ledger,
// and registers host-a (see shRegister).
func shToldHost(t *testing.T) (*coordtest.Server, *shLedger, *shHost) {
	t.Helper()
	srv, _ := newEtcd(t)
	for range 300 {
		wtPut(t, srv.Client(), "/elsewhere/", meta("x"), 0)
	}
	return srv, newShLedger(), shRegister(t, srv, "host-a")[0]
}

// reqHold holds, once started and until released, the unary requests of
// its clients that match.
type reqHold struct {
	match    func(req any) bool
	on       atomic.Bool
	released chan struct{}
	once     sync.Once
}

func newReqHold(match func(req any) bool) *reqHold {
	return &reqHold{match: match, released: make(chan struct{})}
}

// start starts holding.
func (h *reqHold) start() { h.on.Store(true) }

// release lets every request held go, and holds no more.
func (h *reqHold) release() { h.once.Do(func() { close(h.released) }) }

// client returns a client of cfg whose requests h holds.
func (h *reqHold) client(t *testing.T, cfg clientv3.Config) *clientv3.Client {
	t.Helper()
	cfg.DialOptions = append(slices.Clone(cfg.DialOptions),
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any,
			cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			if h.on.Load() && h.match(req) {
				select {
				case <-h.released:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return invoker(ctx, method, req, reply, cc, opts...)
		}))
	c, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// shCandidacies returns, by shard, the candidate keys created under
// ShardsPrefix in etcd's whole history.
func shCandidacies(t *testing.T, cli *clientv3.Client) map[string]int {
	t.Helper()
	out := map[string]int{}
	shReplay(t, cli, ShardsPrefix, func(ev *clientv3.Event) {
		shard, _, ok := strings.Cut(strings.TrimPrefix(string(ev.Kv.Key), ShardsPrefix), "/")
		if ok && shard != ShardMemberSegment && ev.IsCreate() {
			out[shard]++
		}
	})
	return out
}

func testShardClose(t *testing.T) {
	srv, _ := newEtcd(t)
	l := newShLedger()
	// Four shards that a tops: b is their standby.
	var shards []string
	for _, s := range shNames(100) {
		if len(shards) < 4 && ranksBefore(s, "host-a", "host-b") {
			shards = append(shards, s)
		}
	}
	hs := shRegister(t, srv, "host-a", "host-b")
	a := hs[0].start(t, l, ShardOptions{Shards: shards})
	l.until(t, "a owning every shard", func() bool { return len(a.set.Owned()) == len(shards) })
	b := hs[1].start(t, l, ShardOptions{Shards: shards})
	ctx := testCtx(t)
	if owner, err := b.set.Owner(ctx, shards[1]); err != nil || owner != "host-a" {
		t.Fatalf("Owner = %q, %v; want host-a", owner, err)
	}
	mark := l.mark()
	for i := 0; i < 2; i++ {
		if err := a.set.Close(); err != nil {
			t.Fatalf("Close #%d: %v", i+1, err)
		}
	}
	// Close waited for every Run.
	rel := l.since(mark, SignalShardReleased)
	for _, ev := range rel {
		if ev.Host != "host-a" || !errors.Is(ev.Err, ErrClosed) {
			t.Fatalf("released %+v, want a's, closed", ev)
		}
	}
	if got := a.set.Owned(); len(rel) != len(shards) || len(got) != 0 {
		t.Fatalf("%d released, %v owned after Close", len(rel), got)
	}
	l.until(t, "b owning every shard", func() bool { return len(b.set.Owned()) == len(shards) })
	if owner, err := b.set.Owner(ctx, shards[1]); err != nil || owner != "host-b" {
		t.Fatalf("Owner = %q, %v; want host-b", owner, err)
	}
	if _, err := a.set.Owner(ctx, shards[1]); !errors.Is(err, ErrClosed) {
		t.Fatalf("Owner after Close: %v, want ErrClosed", err)
	}
	waitClosed(t, a.set.Done(), "Done after Close")
	if err := a.set.Err(); err != nil {
		t.Fatalf("Err after Close: %v, want nil", err)
	}
}

func testShardCloseWaitsForRun(t *testing.T) {
	srv, _ := newEtcd(t)
	l := newShLedger()
	const drain = 300 * time.Millisecond
	var (
		cause    error
		returned time.Time
		done     = make(chan struct{}) // closed once Run has returned
	)
	a := shRegister(t, srv, "a")[0]
	a.start(t, l, ShardOptions{Shards: []string{"s"}, Run: func(ctx context.Context, s Shard) {
		defer close(done)
		<-ctx.Done()
		cause = context.Cause(ctx)
		// The work goes on for a while after the ctx ended: fenced writes,
		// which hold as long as we have not resigned.
		for end := time.Now().Add(drain); time.Now().Before(end); time.Sleep(shPace) {
			l.write(a.cli, a.id, s)
		}
		returned = time.Now()
	}})
	l.waitEvent(t, 0, SignalShardAcquired, a.id, "s")
	start := time.Now()
	a.set.Close()
	closed := time.Now()
	if !isClosed(done) {
		t.Fatalf("Close returned after %v, before the Run, working %v past its ctx's end, returned", closed.Sub(start), drain)
	}
	t.Logf("Close took %v; the Run returned %v before it returned", closed.Sub(start), closed.Sub(returned))
	if !errors.Is(cause, ErrClosed) || returned.Sub(start) < drain {
		t.Fatalf("the Run returned %v after Close began, its ctx ended because %v; want after %v, ErrClosed", returned.Sub(start), cause, drain)
	}
	if n := len(l.acked()); n == 0 {
		t.Fatal("no fenced write of the Run's work held")
	}
}

func testShardOwner(t *testing.T) {
	srv, cli := newEtcd(t)
	l := newShLedger()
	// Keys under the prefix that are no candidates of ours are skipped,
	// listed or watched.
	put := func(k string) {
		if _, err := cli.Put(testCtx(t), ShardsPrefix+k, "a"); err != nil {
			t.Fatal(err)
		}
	}
	put("unknown/1")
	put("odd")
	a := shRegister(t, srv, "a")[0].start(t, l, ShardOptions{Shards: []string{"s"}})
	put("unknown/2")
	ctx := testCtx(t)
	l.waitEvent(t, 0, SignalShardAcquired, "a", "s")
	if owner, err := a.set.Owner(ctx, "s"); err != nil || owner != "a" {
		t.Fatalf("Owner = %q, %v; want a", owner, err)
	}
	if _, err := a.set.Owner(ctx, "nobody"); !errors.Is(err, ErrNoLeader) {
		t.Fatalf("Owner of a shard nobody campaigns for: %v, want ErrNoLeader", err)
	}
	if _, err := a.set.Owner(ctx, "a/b"); !errors.Is(err, ErrInvalidShards) {
		t.Fatalf("Owner of a/b: %v, want ErrInvalidShards", err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := a.set.Owner(cancelled, "s"); !errors.Is(err, context.Canceled) {
		t.Fatalf("Owner with an ended ctx: %v, want context.Canceled", err)
	}
	if got := a.set.Owned(); len(got) != 1 || got[0].Name != "s" {
		t.Fatalf("Owned = %v, want s alone: the other keys are no shards of ours", got)
	}
}

func testShardUnreachable(t *testing.T) {
	srv, _ := newEtcd(t)
	px := srv.NewProxy(t)
	pcli := px.NewClient(t)
	px.Blackhole()
	defer px.Unblackhole()
	opts := ShardOptions{Shards: []string{"s"}, Self: "a", Run: idle}
	ctx, cancel := context.WithTimeout(testCtx(t), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	if s, err := NewShardSet(ctx, pcli, opts); s != nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("NewShardSet cut off: %v, %v; want DeadlineExceeded", s, err)
	}
	if took := time.Since(start); took > 300*time.Millisecond+200*time.Millisecond*scale {
		t.Fatalf("took %v, the ctx was 300ms", took)
	}
	login := enableAuth(t, srv, map[string][]keyRange{
		"shards-only":   {prefixRange(ShardsPrefix)},
		"hosts-only":    {prefixRange(HostsPrefix)},
		"no-candidates": {prefixRange(HostsPrefix), {memberKey(ShardsPrefix, "a"), ""}},
	})
	if s, err := NewShardSet(testCtx(t), login("shards-only"), opts); s != nil || !errors.Is(err, rpctypes.ErrPermissionDenied) {
		t.Fatalf("NewShardSet without access to the hosts: %v, %v; want permission denied", s, err)
	}
	if s, err := NewShardSet(testCtx(t), login("hosts-only"), opts); s != nil || !errors.Is(err, rpctypes.ErrPermissionDenied) {
		t.Fatalf("NewShardSet that may not announce itself: %v, %v; want permission denied", s, err)
	}
	// It may announce itself, but never list the candidates: it waits
	// for them until its ctx ends.
	ctx, cancel = context.WithTimeout(testCtx(t), 500*time.Millisecond)
	defer cancel()
	if s, err := NewShardSet(ctx, login("no-candidates"), opts); s != nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("NewShardSet that may not read the candidates: %v, %v; want DeadlineExceeded", s, err)
	}
}

func testShardBadInput(t *testing.T) {
	srv, cli := newEtcd(t)
	// A registration of its own, to be named as Host: its lease and key
	// are the only ones the bad input may find.
	host := register(t, srv.NewClient(t), "g", LivenessOptions{})
	ok := ShardOptions{Shards: []string{"a", "b"}, Self: "h", Run: idle}
	with := func(f func(*ShardOptions)) ShardOptions {
		o := ok
		f(&o)
		return o
	}
	cases := []struct {
		name string
		cli  *clientv3.Client
		opts ShardOptions
		want error
	}{
		{"nil client", nil, ok, ErrNilClient},
		{"no shards", cli, with(func(o *ShardOptions) { o.Shards = nil }), ErrInvalidShards},
		{"empty shard name", cli, with(func(o *ShardOptions) { o.Shards = []string{"a", ""} }), ErrInvalidShards},
		{"shard name with /", cli, with(func(o *ShardOptions) { o.Shards = []string{"a/b"} }), ErrInvalidShards},
		{"duplicate shard", cli, with(func(o *ShardOptions) { o.Shards = []string{"a", "b", "a"} }), ErrInvalidShards},
		{"no Self", cli, with(func(o *ShardOptions) { o.Self = "" }), ErrInvalidShards},
		{"Self with /", cli, with(func(o *ShardOptions) { o.Self = "h/1" }), ErrInvalidShards},
		{"no Run", cli, with(func(o *ShardOptions) { o.Run = nil }), ErrInvalidShards},
		{"negative Replicas", cli, with(func(o *ShardOptions) { o.Replicas = -1 }), ErrInvalidShards},
		{"prefix without /", cli, with(func(o *ShardOptions) { o.Prefix = "/shards" }), ErrInvalidKey},
		{"prefix with //", cli, with(func(o *ShardOptions) { o.Prefix = "/a//b/" }), ErrInvalidKey},
		{"prefix over the hosts", cli, with(func(o *ShardOptions) { o.Prefix = "/coord/" }), ErrInvalidKey},
		{"host prefix without /", cli, with(func(o *ShardOptions) { o.HostPrefix = "/hosts" }), ErrInvalidKey},
		{"TTL not whole seconds", cli, with(func(o *ShardOptions) { o.TTL = 1500 * time.Millisecond }), ErrInvalidTTL},
		{"negative TTL", cli, with(func(o *ShardOptions) { o.TTL = -time.Second }), ErrInvalidTTL},
		{"negative KeysPerSession", cli, with(func(o *ShardOptions) { o.KeysPerSession = -1 }), ErrInvalidKeysPerSession},
		{"shard name of the set's own keys", cli, with(func(o *ShardOptions) { o.Shards = []string{"a", ShardMemberSegment} }), ErrInvalidShards},
		{"negative Weight", cli, with(func(o *ShardOptions) { o.Weight = -1 }), ErrInvalidShards},
		{"NaN Weight", cli, with(func(o *ShardOptions) { o.Weight = math.NaN() }), ErrInvalidShards},
		{"infinite Weight", cli, with(func(o *ShardOptions) { o.Weight = math.Inf(1) }), ErrInvalidShards},
		{"negative MaxMoves", cli, with(func(o *ShardOptions) { o.MaxMoves = -1 }), ErrInvalidShards},
		{"negative Settle", cli, with(func(o *ShardOptions) { o.Settle = -time.Second }), ErrInvalidShards},
		{"Self other than Host's", cli, with(func(o *ShardOptions) { o.Host = host }), ErrInvalidShards},
		{"HostPrefix other than Host's", cli, with(func(o *ShardOptions) { o.Self, o.Host, o.HostPrefix = "", host, "/other/" }), ErrInvalidShards},
	}
	said := map[string]string{} // case by message: one message per check
	for _, c := range cases {
		s, err := NewShardSet(testCtx(t), c.cli, c.opts)
		if s != nil || !errors.Is(err, c.want) || strings.Count(err.Error(), "coord:") != 1 {
			t.Fatalf("%s: %v, %v; want %v, saying \"coord:\" once", c.name, s, err, c.want)
		}
		if other, ok := said[err.Error()]; ok {
			t.Errorf("%s and %s: both %q, want a message naming what is wrong", other, c.name, err)
		}
		said[err.Error()] = c.name
	}
	if n := keyCount(t, cli, ""); n != 1 {
		t.Fatalf("%d keys written, want only the registration's", n)
	}
	if ls := ptLeases(t, cli); !slices.Equal(ls, []clientv3.LeaseID{host.LeaseID()}) {
		t.Fatalf("leases %v; want only the registration's", ls)
	}
	if _, err := (&ShardSet{}).Owner(testCtx(t), "@x"); !errors.Is(err, ErrInvalidShards) {
		t.Fatalf("Owner of a name of the set's own keys: %v, want ErrInvalidShards", err)
	}
}

func TestShardSetCloseUnreachable(t *testing.T) {
	t.Parallel() // bound by a TTL: see "Parallel tests" in helpers_test.go
	t.Run("Close on an unreachable etcd returns within about one TTL", func(t *testing.T) {
		srv, l, shards, _ := shFleet(t, 8, 0)
		h := shRegister(t, srv, "host-00")[0]
		ttl := 2 * time.Second * scale
		h.start(t, l, ShardOptions{Shards: shards, TTL: ttl})
		l.until(t, "host-00 owning every shard", func() bool { return len(h.set.Owned()) == len(shards) })
		h.px.Blackhole()
		defer h.px.Unblackhole()
		start := time.Now()
		h.set.Close()
		// The Runs return at once; the pool's revoke is then bounded by
		// the TTL, not each shard's resign first.
		if took, limit := time.Since(start), ttl+ttl/5; took > limit {
			t.Fatalf("Close took %v on an unreachable etcd, want at most %v (TTL %v)", took, limit, ttl)
		} else {
			t.Logf("Close took %v on an unreachable etcd (TTL %v)", took, ttl)
		}
	})
}

// rangeCounter counts a client's range reads under a prefix with a limit,
// and runs before, if set, ahead of each read at a given revision (a
// later page).
type rangeCounter struct {
	prefix string
	mu     sync.Mutex
	firsts int    // reads at the latest revision
	laters int    // reads at a given revision
	before func() // see beforeNext
}

func (c *rangeCounter) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if r, ok := req.(*pb.RangeRequest); ok && r.Limit > 0 && strings.HasPrefix(string(r.Key), c.prefix) {
		c.mu.Lock()
		before := c.before
		if r.Revision == 0 {
			c.firsts++
		} else {
			c.laters++
			c.before = nil
		}
		c.mu.Unlock()
		if r.Revision != 0 && before != nil {
			before()
		}
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// beforeNext makes f run before the next read at a given revision.
func (c *rangeCounter) beforeNext(f func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.before = f
}

// counts returns the reads counted so far.
func (c *rangeCounter) counts() (firsts, laters int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.firsts, c.laters
}

// client returns a client made from cfg whose range reads c counts.
func (c *rangeCounter) client(t *testing.T, cfg clientv3.Config) *clientv3.Client {
	t.Helper()
	return interceptedClient(t, cfg, c.intercept)
}

// putForeign puts n keys under prefix+"a-foreign/", in transactions of
// etcd's default limit of operations: keys of another program, or of a
// later version, that sort before the set's shards.
func putForeign(t *testing.T, cli *clientv3.Client, prefix string, n int) {
	t.Helper()
	for i := 0; i < n; i += 128 {
		var ops []clientv3.Op
		for j := i; j < min(i+128, n); j++ {
			ops = append(ops, clientv3.OpPut(fmt.Sprintf("%sa-foreign/%05d", prefix, j), "x"))
		}
		if _, err := cli.Txn(testCtx(t)).Then(ops...).Commit(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestListPrefix(t *testing.T) {
	t.Parallel()
	srv, cli := newEtcd(t)
	const prefix = "/list/"
	putForeign(t, cli, prefix, 2500)
	if _, err := cli.Put(testCtx(t), "/list0", "a key after the prefix's range"); err != nil {
		t.Fatal(err)
	}
	whole, err := cli.Get(testCtx(t), prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	rc := &rangeCounter{prefix: prefix}
	pcli := rc.client(t, srv.ClientConfig())
	t.Run("every page, at the first one's revision", func(t *testing.T) {
		got, err := listPrefix(testCtx(t), pcli, prefix, 1000)
		if err != nil {
			t.Fatal(err)
		}
		if got.Header.Revision != whole.Header.Revision || got.More || got.Count != 2500 || len(got.Kvs) != 2500 {
			t.Fatalf("revision %d (want %d), more %v, count %d, %d keys; want 2500", got.Header.Revision, whole.Header.Revision, got.More, got.Count, len(got.Kvs))
		}
		for i, kv := range got.Kvs {
			if !proto.Equal(kv, whole.Kvs[i]) {
				t.Fatalf("key %d: %v, want %v", i, kv, whole.Kvs[i])
			}
		}
		if firsts, laters := rc.counts(); firsts != 1 || laters != 2 {
			t.Fatalf("%d first and %d later pages read, want 1 and 2", firsts, laters)
		}
	})
	t.Run("a revision compacted between pages fails the listing", func(t *testing.T) {
		rc.beforeNext(func() {
			if _, err := cli.Put(testCtx(t), prefix+"c", "a change between pages"); err != nil {
				t.Error(err)
			}
			srv.Compact(testCtx(t))
		})
		if _, err := listPrefix(testCtx(t), pcli, prefix, 1000); !errors.Is(err, rpctypes.ErrCompacted) {
			t.Fatalf("listPrefix: %v, want ErrCompacted", err)
		}
	})
}

func TestShardSetPagedListing(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	// More keys under the set's prefix than a page holds, before its
	// shards': the members list in pages, once after a compaction between
	// two of them, and own every shard.
	srv, l, shards, hosts := shFleet(t, 4, 2)
	putForeign(t, srv.Client(), ShardsPrefix, shardListPage+100)
	shStartAll(t, l, hosts[1:], ShardOptions{Shards: shards})
	rc := &rangeCounter{prefix: ShardsPrefix}
	rc.beforeNext(func() {
		if _, err := srv.Client().Put(testCtx(t), ShardsPrefix+"a-foreign/new", "x"); err != nil {
			t.Error(err)
		}
		srv.Compact(testCtx(t))
	})
	hosts[0].cli = rc.client(t, hosts[0].px.ClientConfig())
	hosts[0].start(t, l, ShardOptions{Shards: shards})
	shSettle(t, l, shards, hosts, hosts)
	if _, laters := rc.counts(); laters < 2 {
		t.Fatalf("%d later pages read, want one compacted away and one of a listing again", laters)
	}
}
