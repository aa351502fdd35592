package coord

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"
)

// watchTap counts, by shard, the candidate events a client's watches
// receive from etcd.
type watchTap struct {
	mu  sync.Mutex
	got map[string]int // events received, by shard
}

func (w *watchTap) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return wrapWatch(ctx, desc, cc, method, streamer, opts, func(s grpc.ClientStream) grpc.ClientStream { return &tapStream{ClientStream: s, w: w} })
}

// take returns the counts since the last take, and starts over.
func (w *watchTap) take() map[string]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	got := w.got
	w.got = map[string]int{}
	return got
}

type tapStream struct {
	grpc.ClientStream
	w *watchTap
}

func (s *tapStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if wr, ok := m.(*pb.WatchResponse); ok && err == nil {
		s.w.mu.Lock()
		for _, ev := range wr.Events {
			shard, _, ok := strings.Cut(strings.TrimPrefix(string(ev.Kv.Key), ShardsPrefix), "/")
			if ok && strings.HasPrefix(string(ev.Kv.Key), ShardsPrefix) && shard != ShardMemberSegment {
				s.w.got[shard]++
			}
		}
		s.w.mu.Unlock()
	}
	return err
}

// shScope returns the shards whose first replicas+1 of hosts, ranked,
// include host: those it follows.
func shScope(shards, hosts []string, host string, replicas int) map[string]bool {
	in := map[string]bool{}
	for _, s := range shards {
		r := shRank(s, hosts)
		if slices.Contains(r[:min(len(r), replicas+1)], host) {
			in[s] = true
		}
	}
	return in
}

// followed returns the shards whose candidates set follows, read.
func followed(set *ShardSet) map[string]bool {
	set.mu.Lock()
	defer set.mu.Unlock()
	out := map[string]bool{}
	for shard := range set.view.follows {
		if set.followedLocked(shard) {
			out[shard] = true
		}
	}
	return out
}

func TestShardScopedWatches(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	const replicas = 1
	srv, l, shards, _ := shFleet(t, 60, 0)
	ids := shIDs(6)
	var hs []*shHost
	taps := map[string]*watchTap{}
	for _, id := range ids {
		tap := &watchTap{got: map[string]int{}}
		cli := streamInterceptedClient(t, srv.ClientConfig(), tap.stream)
		hs = append(hs, &shHost{id: id, cli: cli, live: register(t, cli, id, LivenessOptions{TTL: time.Second * scale})})
		taps[id] = tap
	}
	opts := ShardOptions{Shards: shards, Replicas: replicas}
	shStartAll(t, l, hs, opts)
	// scoped waits until every member of live follows its scope, no more
	// and no less, and returns the scopes.
	scoped := func(live []*shHost) map[string]map[string]bool {
		scopes := map[string]map[string]bool{}
		for _, h := range live {
			want := shScope(shards, shIDsOf(live), h.id, replicas)
			if len(want) == 0 || len(want) == len(shards) {
				t.Fatalf("%s's scope: %d of %d shards; want some, not all", h.id, len(want), len(shards))
			}
			eventually(t, h.id+" following its scope", func() bool { return maps.Equal(followed(h.set), want) })
			scopes[h.id] = want
		}
		return scopes
	}
	before := scoped(hs)
	for _, tap := range taps {
		tap.take()
	}
	// A member leaves: every shard it took part in moves, and the scopes
	// of the others change.
	hs[5].set.Close()
	shSettle(t, l, shards, hs[:5], hs)
	after := scoped(hs[:5])
	total := 0
	for _, h := range hs[:5] {
		got := taps[h.id].take()
		var out []string
		for shard := range got {
			if !before[h.id][shard] && !after[h.id][shard] {
				out = append(out, shard)
			}
		}
		if len(out) > 0 {
			t.Fatalf("%s received candidate events of %d shards, %d of them never in its scope (%v)", h.id, len(got), len(out), out)
		}
		total += len(got)
		t.Logf("%s: candidate events of %d shards, all in its scope (%d shards before, %d after)", h.id, len(got), len(before[h.id]), len(after[h.id]))
	}
	if total == 0 {
		t.Fatal("no member received a candidate event: nothing was checked")
	}
	// It joins again: the scopes are those of the start.
	hs[5].start(t, l, opts)
	shSettle(t, l, shards, hs, hs)
	if again := scoped(hs); !maps.EqualFunc(again, before, maps.Equal) {
		t.Fatalf("scopes after the join differ from the start's")
	}
}

// A shard that comes into a member's scope is read before anything is
// decided on it: while the read is held, the member does not campaign for
// it, though it ranks first; a read cut short by Close ends nothing else.
func TestShardScopeRead(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	srv, l, _, _ := shFleet(t, 0, 0)
	ids := shIDs(4)
	x := shRankedAs(ids...)
	hold := newReqHold(func(req any) bool {
		r, ok := req.(*pb.RangeRequest)
		return ok && string(r.Key) == ShardsPrefix+x+"/"
	})
	hs := shRegister(t, srv, ids[0], ids[1], ids[3])
	c := &shHost{id: ids[2], cli: hold.client(t, srv.ClientConfig())}
	c.live = register(t, c.cli, c.id, LivenessOptions{TTL: time.Second * scale})
	a, b, d := hs[0], hs[1], hs[2]
	opts := ShardOptions{Shards: []string{x}, Replicas: 1}
	shStartAll(t, l, []*shHost{a, b, c, d}, opts)
	hold.start()
	a.set.Close()
	b.set.Close()
	// c now ranks first for x: it follows x, but has not read it.
	eventually(t, "c following x", func() bool {
		c.set.mu.Lock()
		defer c.set.mu.Unlock()
		return c.set.view.follows[x] != nil && len(c.set.view.members) == 2
	})
	if followed(c.set)[x] {
		t.Fatal("c read x's candidates through a held read")
	}
	ctx := testCtx(t)
	if owner, err := d.set.Owner(ctx, x); !errors.Is(err, ErrNoLeader) {
		t.Fatalf("x owned by %q (%v) while its first member's read is held; want no owner", owner, err)
	}
	if n := len(c.set.Owned()); n != 0 {
		t.Fatalf("c owns %d shards on an unread view", n)
	}
	// Closed while its read is held: the read ends with the set, and d,
	// next, takes x.
	c.set.Close()
	shSettle(t, l, []string{x}, []*shHost{d}, []*shHost{a, b, c, d})
}

// A shard's watch that breaks alone (here: started at a revision
// compacted meanwhile) ends the view, which is listed again: the member
// takes the shard all the same.
func TestShardScopeWatchBroken(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	srv, l, _, _ := shFleet(t, 0, 0)
	ids := shIDs(4)
	x := shRankedAs(ids...)
	hold := newCreateHold(ShardsPrefix + x + "/")
	hs := shRegister(t, srv, ids[0], ids[1], ids[3])
	tap, logger := newLogTap()
	cli := streamInterceptedClient(t, srv.ClientConfig(), hold.stream)
	c := &shHost{id: ids[2], cli: cli, live: register(t, cli, ids[2], LivenessOptions{TTL: time.Second * scale})}
	a, b, d := hs[0], hs[1], hs[2]
	opts := ShardOptions{Shards: []string{x}, Replicas: 1}
	shStartAll(t, l, []*shHost{a, b, d}, opts)
	opts.Logger = logger
	c.start(t, l, opts)
	hold.armed.Store(true)
	// c comes to rank first for x: it reads x, and its watch of x, held,
	// starts at a revision compacted before it reaches etcd.
	a.set.Close()
	b.set.Close()
	waitClosed(t, hold.held, "c's watch of x")
	ctx := testCtx(t)
	if _, err := srv.Client().Put(ctx, "/elsewhere/k", ""); err != nil {
		t.Fatal(err)
	}
	srv.Compact(ctx)
	close(hold.release)
	eventually(t, "c saying its watch broke", func() bool { return tap.count("coord: shard set: candidate watch broke, listing again") > 0 })
	shSettle(t, l, []string{x}, []*shHost{c, d}, []*shHost{a, b, c, d})
}
