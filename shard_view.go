package coord

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/metadata"
)

// How a member follows the set in etcd: it lists the whole set once (the
// members and every shard's candidates, in pages), then watches the
// members, and the candidates of only the shards it follows (its scope:
// see scopedLocked), each from the revision it was read at. A shard that
// comes into scope is read, then watched; one that leaves it is no longer
// watched, and forgotten. So a member receives the events of the shards
// it may take part in, not of the whole set: its cost falls as the fleet
// grows, and etcd sends each shard's events to a few members, not to all.
//
// Every decision on a shard is taken on a view of it that is complete:
// the members, and its candidates since the revision they were read at.
// Each watch goes on from where its read left off, so the views of two
// shards may be at different revisions; what a won shard runs on is
// caught up first (see catchUp).

// shardView is what we know of the live hosts, the members and the
// candidates of the shards we follow, and how far it has reached in etcd.
// Guarded by ShardSet.mu, but for replaced and mark, which are safe on
// their own.
type shardView struct {
	hosts       map[string]bool                 // live hosts, Self included
	members     map[string]ShardMember          // announced members, by HostUUID
	cands       map[string]map[string]candidate // by shard, by candidate key: of the shards we follow
	hostsSynced bool
	candsListed bool
	candsLost   time.Time // when a watch of the set broke, zero while they run
	// gen is the view's life since the set was last listed, nil once
	// a watch broke and until it is listed again; follows holds the
	// shards we follow (or followed, until the listing), by name.
	gen     *viewGen
	follows map[string]*shardFollow
	// rev is the etcd revision our view of the members has reached;
	// waits holds, by shard, the won shards waiting for our view to
	// reach their revision, and asked when they last asked etcd where
	// each stream's watches are (see catchUp).
	rev   int64
	waits map[string][]*catchWait
	asked map[string]time.Time
	// replaced holds the word that etcd was replaced (see heard), until
	// our view is listed again; mark follows the etcd of our view, from
	// its answers and ours; told carries the host watcher's word that its
	// own etcd was replaced, for askReplaced.
	replaced *replacedNote
	mark     etcdMark
	told     chan struct{}
	// awaited holds, once etcd was found replaced, the members that were
	// live before, until the TTL has passed (awaitEnd then clears it):
	// see memberLocked.
	awaited  map[string]ShardMember
	awaitEnd *time.Timer
}

// viewGen is a view's life from a listing of the set: the watches of the
// members and of the shards followed, which end together, with its ctx.
type viewGen struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	// listed is the listing's revision, until the first scoping after
	// it, which follows the shards in scope from there (0 after: a shard
	// that comes into scope later is read first).
	listed int64
	wg     sync.WaitGroup // its shard follows
}

// shardFollow is the following of one shard's candidates.
type shardFollow struct {
	shard string
	stop  context.CancelFunc
	at    int64 // the revision its candidates have reached; 0 until read
}

// watchFrom: our view's watches start at the revision their keys were read
// at, not the next one, and take its events again (they change nothing:
// the read has them). etcd answers a progress request on a stream only
// once every watch of it has reached etcd's revision, and takes a watch
// that starts at the next one, not written yet, as not there: a view
// watch started after a read would hold catchUp back until the next
// write to etcd, for good on a quiet etcd. One that starts at the read's
// catches up within one of etcd's syncs of its watches (every 100 ms).

// errViewEnded ends a view's watches: it is listed again.
var errViewEnded = errors.New("the set is listed again")

// shardListPage is how many keys of the set (members and candidates, each
// some 100 bytes in etcd's response) a page of its listing holds.
const shardListPage = 5000

// followCandidates keeps the members and the followed shards' candidates:
// it lists the set, then watches, and lists again whenever a watch breaks
// (compaction, lost leader, refusal, etcd replaced), until the shard set
// ends.
func (s *ShardSet) followCandidates() {
	defer s.wg.Done()
	var r retry
	for {
		since := s.view.mark.at()
		resp, err := listPrefix(s.ctx, s.cli, s.opts.Prefix, shardListPage)
		if err == nil {
			g := &viewGen{listed: resp.Header.Revision}
			g.ctx, g.cancel = context.WithCancelCause(s.ctx)
			s.update(func() { s.listedLocked(resp, since, g) })
			err = s.watchMembers(g, resp.Header.Revision, &r)
			s.mu.Lock()
			g.cancel(errViewEnded)
			s.view.gen = nil // no follow starts after: see scopeLocked
			s.mu.Unlock()
			g.wg.Wait()
		}
		if s.ctx.Err() != nil {
			return
		}
		s.candidatesLost()
		s.log.Info("coord: shard set: candidate watch broke, listing again", "err", err)
		if !errors.Is(err, errEtcdReplaced) {
			sleep(s.ctx, r.next())
		}
		relistPause(s.ctx, s.cli, s.opts.Prefix)
	}
}

// listedLocked makes resp, a listing of the set, our view, the life of
// g: each shard in scope is followed from it at the first refresh (see
// reconcileAllLocked).
func (s *ShardSet) listedLocked(resp *clientv3.GetResponse, since *markAt, g *viewGen) {
	for shard := range s.view.cands {
		s.view.cands[shard] = map[string]candidate{}
	}
	clear(s.view.members)
	for _, kv := range resp.Kvs {
		s.noteLocked(kv, false)
	}
	if err := s.view.mark.see(resp.Header, since); err != nil {
		s.log.Error("coord: shard set: etcd was replaced or restored, listing the members and candidates again", "err", err)
		emit(s.opts.OnSignal, Signal{Kind: SignalEtcdReplaced, Key: s.opts.Prefix, Host: s.opts.Self, Err: err})
	}
	s.view.replaced.clear()
	s.view.gen, s.view.follows = g, map[string]*shardFollow{}
	// Our member key may have gone while we were not watching: it is put
	// again, whether or not it did.
	s.askReannounceLocked()
	s.view.candsListed, s.view.candsLost = true, time.Time{}
	// Every shard's candidates may have changed.
	s.rank.refreshed = false
	s.viewAtLocked(resp.Header.Revision)
}

// watchMembers applies the members' changes from rev, the listing's, on
// (see watchFrom), until a watch of g breaks (its error) or the shard set
// ends (nil).
func (s *ShardSet) watchMembers(g *viewGen, rev int64, r *retry) error {
	go func() {
		for {
			select {
			case <-s.view.replaced.wake: // our view forgotten already: see forgetReplaced
				g.cancel(s.view.replaced.get())
				return
			case <-s.view.told:
				s.askReplaced(g.ctx, "the host watcher found its etcd replaced")
			case <-g.ctx.Done():
				return
			}
		}
	}()
	key, ctx := memberKey(s.opts.Prefix, ""), s.viewCtx(g.ctx, viewMembers)
	for wr := range responses(ctx, s.cli.Watch(ctx, key, clientv3.WithPrefix(), clientv3.WithRev(rev))) {
		if err := wr.Err(); err != nil {
			return err
		}
		*r = retry{}
		s.heard(wr.Header, nil)
		s.mu.Lock()
		s.viewAtLocked(wr.Header.Revision)
		for _, ev := range wr.Events {
			s.noteLocked(ev.Kv, ev.Type == mvccpb.DELETE)
		}
		// A member event need not change any ranking (a key put again
		// unchanged): the refresh then reconciles no shard.
		if len(wr.Events) > 0 {
			s.refreshLocked()
		}
		s.mu.Unlock()
	}
	if s.ctx.Err() != nil {
		return nil
	}
	return context.Cause(g.ctx)
}

// scopedLocked reports whether we follow shard's candidates: we work on
// it, or rank among the shard's candidates, or next after them (the
// member that takes part when one of them leaves, its view ready).
func (s *ShardSet) scopedLocked(shard string) bool {
	if s.workers[shard] != nil || s.rank.ranked[shard] {
		return true
	}
	o := s.rank.order[shard]
	return slices.ContainsFunc(o[:min(len(o), s.opts.Replicas+1)], func(m rankedMember) bool { return m.HostUUID == s.opts.Self })
}

// scopeLocked starts following shard when it comes into our scope, and
// stops when it leaves it; nothing while the set is being listed again.
func (s *ShardSet) scopeLocked(shard string) {
	g, f := s.view.gen, s.view.follows[shard]
	switch in := s.scopedLocked(shard); {
	case g == nil:
	case in && f == nil:
		f = &shardFollow{shard: shard, at: g.listed}
		ctx, stop := context.WithCancel(s.viewCtx(g.ctx, viewShards))
		f.stop = stop
		s.view.follows[shard] = f
		s.wakeLocked(shard) // f starts at the listing
		g.wg.Add(1)
		go s.followShard(ctx, g, f)
	case !in && (f != nil || g.listed != 0):
		if f != nil {
			f.stop()
			delete(s.view.follows, shard)
		}
		s.view.cands[shard] = map[string]candidate{}
	}
}

// followedLocked reports whether shard's candidates are known: we follow
// it, and it has been read.
func (s *ShardSet) followedLocked(shard string) bool {
	f := s.view.follows[shard]
	return f != nil && f.at != 0
}

// followShard follows f's candidates in ctx, a part of g: it reads them
// unless the listing did, then watches them from there. Its view of the
// shard counts only while f is the shard's follow (not after a scope out,
// nor after a listing). A watch that breaks ends g, to be listed again
// (a follow that ends, its ctx cancelled, gets no error: its channel
// closes).
func (s *ShardSet) followShard(ctx context.Context, g *viewGen, f *shardFollow) {
	defer g.wg.Done()
	key := s.opts.Prefix + f.shard + "/"
	s.mu.Lock()
	from := f.at
	s.mu.Unlock()
	if from == 0 {
		since := s.view.mark.at()
		resp := s.readShard(ctx, key)
		if resp == nil {
			return
		}
		s.heard(resp.Header, since)
		from = resp.Header.Revision
		s.mu.Lock()
		if s.view.follows[f.shard] == f {
			cands := map[string]candidate{}
			for _, kv := range resp.Kvs {
				cands[string(kv.Key)] = candidate{host: string(kv.Value), rev: kv.CreateRevision}
			}
			s.view.cands[f.shard] = cands
			s.shardAtLocked(f, from)
		}
		s.mu.Unlock()
	}
	// From the revision read, not the next: see watchFrom.
	for wr := range responses(ctx, s.cli.Watch(ctx, key, clientv3.WithPrefix(), clientv3.WithRev(from))) {
		if err := wr.Err(); err != nil {
			g.cancel(err) // a watch broken (compacted, no leader): list again
			return
		}
		s.heard(wr.Header, nil)
		s.mu.Lock()
		if s.view.follows[f.shard] == f {
			for _, ev := range wr.Events {
				s.noteLocked(ev.Kv, ev.Type == mvccpb.DELETE)
			}
			s.shardAtLocked(f, wr.Header.Revision)
		}
		s.mu.Unlock()
	}
}

// readShard reads the keys under key until etcd answers, or returns nil
// once ctx ends (out of scope, or the view ended).
func (s *ShardSet) readShard(ctx context.Context, key string) *clientv3.GetResponse {
	for r := (retry{}); ; {
		resp, err := s.cli.Get(ctx, key, clientv3.WithPrefix())
		if err == nil {
			return resp
		}
		if !sleep(ctx, r.next()) {
			return nil
		}
	}
}

// shardAtLocked records that f's view of its shard has reached revision
// rev, and reconciles the shard.
func (s *ShardSet) shardAtLocked(f *shardFollow, rev int64) {
	if rev > f.at {
		f.at = rev
		s.wakeLocked(f.shard)
	}
	s.reconcileLocked(f.shard)
}

// heard takes in what h, an answer of etcd, says of it (linear: see
// etcdMark.see): an etcd that replaced the one of our view has our view
// forgotten at once, and listed again (see forgetReplaced).
func (s *ShardSet) heard(h *etcdserverpb.ResponseHeader, since *markAt) {
	if err := s.view.mark.replacedBy(h, since); err != nil {
		s.forgetReplaced(err)
	}
}

// forgetReplaced forgets our view, of an etcd replaced as err says, and
// wakes the lister (see watchMembers): at once, for what is decided next
// must not be decided on the old etcd's candidates (a win there would be
// handed over to a candidate that no longer exists); and under our lock,
// for a listing between the two would be forgotten with no word left to
// list again.
func (s *ShardSet) forgetReplaced(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.view.replaced.set(err)
	s.forgetViewLocked()
}

// askReplaced asks etcd, in ctx, whether the etcd of our view was
// replaced: a linearizable answer compared with what our view has seen
// (see heard). It is asked for why: a word that does not say which etcd it
// is of. The host watcher's often comes after our view has listed the new
// etcd itself (each finds a replacement its own way, the watcher's silent
// watch only by its probe); a campaign's session that ended is often the
// first sign, and the campaign would queue again at once on the new etcd,
// a standby before the owner. When it was replaced, the view is forgotten
// at once, the campaigns waiting in line held (see forgetReplaced), and
// askReplaced returns the error saying so; else, or once ctx ends (a view
// that ended is listed again anyway, and compared then), nil.
func (s *ShardSet) askReplaced(ctx context.Context, why string) error {
	for r := (retry{}); ctx.Err() == nil; sleep(ctx, r.next()) {
		since := s.view.mark.at()
		resp, err := s.cli.Get(ctx, s.opts.Prefix, clientv3.WithCountOnly())
		if err != nil {
			continue
		}
		if err = s.view.mark.replacedBy(resp.Header, since); err == nil {
			s.log.Debug("coord: shard set: etcd asked whether it was replaced: it was not", "why", why,
				"revision", resp.Header.Revision)
			return nil
		}
		s.forgetReplaced(err)
		return err
	}
	return nil
}

// forgetViewLocked forgets the candidates of our view, which are of an
// etcd that was replaced: its revisions say nothing of the new one's.
// Nothing is decided until the view is listed again, and a shard won
// meanwhile runs only once it has (see catchUp). The members stay: they
// announce themselves again on the new etcd, and our shards are not let go
// for want of them.
func (s *ShardSet) forgetViewLocked() {
	for shard := range s.view.cands {
		s.view.cands[shard] = map[string]candidate{}
	}
	s.view.candsListed, s.view.rev = false, 0
	s.awaitLocked()
	// The campaigns waiting in line queue again on the new etcd, where
	// the line is empty, as soon as they find their session gone: a
	// standby's, put before the owner's, would win and hand over. They
	// wait for the listing instead, and for the first candidate there.
	for _, w := range s.workers {
		if w.queued {
			w.requeue = true
			w.endTerm(s.view.replaced.get())
		}
	}
}

// awaitLocked records the members live now as awaited on a new etcd, for
// the TTL from now. Every lease is gone with the old etcd: each member
// registers and announces itself again, at its own pace (a renewal that
// finds its lease gone, a probe that finds its watch silent). Taken for
// gone meanwhile, a member would lose its shards to the first member
// back, only to have them handed back; and we would let ours go while our
// own registration heals. A member that does not come back within the TTL
// is gone: its lease, had etcd stayed, would have expired by then.
func (s *ShardSet) awaitLocked() {
	for h := range s.view.members {
		if m, live := s.memberLocked(h); live {
			s.view.awaited[h] = m
		}
	}
	s.view.awaitEnd.Reset(s.opts.TTL)
}

// viewAtLocked records that our view of the members has reached revision
// rev.
func (s *ShardSet) viewAtLocked(rev int64) {
	if rev > s.view.rev {
		s.view.rev = rev
		for shard := range s.view.waits {
			s.wakeLocked(shard)
		}
	}
}

// catchWait is a won shard's wait for our view to reach rev (see
// catchUp): caught is closed once it has.
type catchWait struct {
	rev    int64
	caught chan struct{}
}

// caughtUpLocked reports whether our view of the members and of shard's
// candidates has reached revision rev, with how far each has.
func (s *ShardSet) caughtUpLocked(shard string, rev int64) (ok bool, members, at int64) {
	if f := s.view.follows[shard]; f != nil {
		at = f.at
	}
	return s.view.rev >= rev && at >= rev, s.view.rev, at
}

// wakeLocked ends the waits of shard that our view has caught up with.
// Only the waits it may end are looked at: a view that moves does not
// wake every won shard waiting (at a fleet's cold start, a member wins
// a hundred shards at once, and its view moves on each candidate put).
func (s *ShardSet) wakeLocked(shard string) {
	waits := slices.DeleteFunc(s.view.waits[shard], func(cw *catchWait) bool {
		ok, _, _ := s.caughtUpLocked(shard, cw.rev)
		if ok {
			close(cw.caught)
		}
		return ok
	})
	s.setWaitsLocked(shard, waits)
}

// setWaitsLocked records waits as shard's (see catchUp).
func (s *ShardSet) setWaitsLocked(shard string, waits []*catchWait) {
	if len(waits) == 0 {
		delete(s.view.waits, shard)
		return
	}
	s.view.waits[shard] = waits
}

// The gRPC streams of our view's watches: the members' watch has one of
// its own, so that etcd answers a progress request on it at once, whatever
// the shards' watches do (see viewCtx).
const (
	viewMembers = "members"
	viewShards  = "shards"
)

// viewCtx returns ctx for the watches of the set on stream (viewMembers or
// viewShards), and for the progress asked of them: it requires a leader,
// and the stream is ours alone. etcd answers a progress request only once
// every watch of the stream has caught up and none starts past its
// revision: on the stream our candidacies share, a monitor just started
// from the revision after its win would hold catchUp's request back until
// the next write, while its own Run, the writer, waits for catchUp; and
// a shard's watch just started behind etcd's revision (one that came into
// scope) holds it back until etcd's next sync of its watches, up to 100
// ms later.
func (s *ShardSet) viewCtx(ctx context.Context, stream string) context.Context {
	return metadata.AppendToOutgoingContext(clientv3.WithRequireLeader(ctx), "coord-view", fmt.Sprintf("%p/%s", s, stream))
}

// catchUpAskEvery bounds the pause between two progress requests of a won
// shard waiting for our view (see catchUp): etcd does not answer one while
// a watch of the stream is behind (at a cold start, for a second or more),
// and a shard must not sleep long past when it would. The requests are
// shared, so asking often costs etcd one request a stream, not one a shard.
const catchUpAskEvery = 200 * time.Millisecond

// catchUp waits, within ctx, until our view of the members and of shard's
// candidates has reached revision rev: a shard won at rev runs only on a
// view that knows what etcd held then (our member key gone, say, while
// etcd was without quorum). A view with nothing to tell since (no change
// of the members or the shard) asks etcd where its watches are, and again
// with backoff, up to catchUpAskEvery (etcd answers every watch of the
// stream at once, once every one has caught up).
func (s *ShardSet) catchUp(ctx context.Context, shard string, rev int64) {
	s.mu.Lock()
	ok, members, at := s.caughtUpLocked(shard, rev)
	if ok {
		s.mu.Unlock()
		return
	}
	cw := &catchWait{rev: rev, caught: make(chan struct{})}
	s.view.waits[shard] = append(s.view.waits[shard], cw)
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.setWaitsLocked(shard, slices.DeleteFunc(s.view.waits[shard], func(w *catchWait) bool { return w == cw }))
	}()
	s.log.Debug("coord: shard won, waiting for our view to catch up", "members", members, "shard", at, "won", rev)
	var r retry
	t := time.NewTimer(0)
	defer t.Stop()
	// A progress asked after need is answered at our revision or past it:
	// etcd answers with its own, once every watch of the stream has
	// caught up, and we won before need.
	need := time.Now()
	for {
		select {
		case <-cw.caught:
			return
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now, ask := time.Now(), []string{}
		s.mu.Lock()
		_, members, at = s.caughtUpLocked(shard, rev)
		for stream, behind := range map[string]bool{viewMembers: members < rev, viewShards: at < rev} {
			// One request serves every won shard waiting on the stream
			// (at a cold start, hundreds): one asked since need will do.
			if behind && !s.view.asked[stream].After(need) {
				s.view.asked[stream] = now
				ask = append(ask, stream)
			}
		}
		s.mu.Unlock()
		// A watch's stream is the one of its ctx's metadata.
		for _, stream := range ask {
			s.cli.RequestProgress(s.viewCtx(ctx, stream))
		}
		need = now
		t.Reset(min(r.next(), catchUpAskEvery))
	}
}

// noteLocked records a member or candidate key put or deleted; keys that
// are neither members nor candidates of our shards are skipped.
func (s *ShardSet) noteLocked(kv *mvccpb.KeyValue, deleted bool) {
	shard, lease, ok := strings.Cut(strings.TrimPrefix(string(kv.Key), s.opts.Prefix), "/")
	if shard == ShardMemberSegment && ok {
		s.noteMemberLocked(kv, lease, deleted)
		return
	}
	cands, known := s.view.cands[shard]
	switch {
	case !ok || !known || strings.Contains(lease, "/"):
	case deleted:
		delete(cands, string(kv.Key))
	default:
		cands[string(kv.Key)] = candidate{host: string(kv.Value), rev: kv.CreateRevision}
	}
}

// noteMemberLocked records host's member key put or deleted; ours, deleted
// while we live, is put again.
func (s *ShardSet) noteMemberLocked(kv *mvccpb.KeyValue, host string, deleted bool) {
	m, ok := decodeMember(s.opts.Prefix, kv)
	switch {
	case deleted:
		delete(s.view.members, host)
		if host == s.opts.Self {
			s.askReannounceLocked()
		}
	case !ok:
		s.log.Warn("coord: shard set: skipping a member key that is not a member's", "key", string(kv.Key))
		delete(s.view.members, host)
	default:
		s.view.members[host] = m
	}
}
