package coord

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// ShardSet spreads work, split into named shards, over the members of a
// fleet: the live hosts that run a ShardSet on the same Prefix. Each
// member announces itself under Prefix (its Weight, Zone and whether it
// drains), on a lease it keeps alive. Every member ranks each shard's live
// members by weighted rendezvous (highest random weight) hashing of the
// shard name and the HostUUID; the top Replicas (spread over zones)
// campaign in the shard's election (at Prefix+name, identity Self), and
// the best-ranked one that campaigns owns the shard: a member joining or
// leaving moves only its share, and only to or from it. A host that only
// registers liveness, or runs a set on another Prefix, takes no slot.
//
// While we own a shard, Run runs with its fencing token and Guard. Its ctx
// ends when we must let go, and context.Cause of it wraps exactly one of:
// ErrRebalanced (a better-ranked member is ready to take the shard, or we
// no longer rank among its candidates), ErrDraining (Drain),
// ErrLeadershipLost (our leadership ended), ErrHostGone (we are not live,
// or our registration is gone), ErrClosed (Close), ErrClientClosed (the
// client was closed). Once Run returns we
// resign, and the next candidate, already in line, owns the shard: a
// handoff has no overlap, and a gap of Run's drain plus a couple of etcd
// round trips. A standby better ranked than the owner waits for that
// handoff; it never preempts. We take over at most MaxMoves shards at
// once from another live member (a shard without an owner is taken at
// once), and hand over at most MaxMoves at once. A Run that returns before its ctx ends gives the shard up the
// same way; we queue again after a pause. A leadership that stepped down
// for unanswered renewals (ErrLeadershipLost: an etcd leader change, a
// cut) is not given up: the next campaign takes the shard back with the
// same token once etcd answers again, if the lease lived on, and Run runs
// again.
//
// Decisions are taken on complete views only: nothing is campaigned for
// before the live hosts, the members and the candidates are all read.
//
// It is safe for concurrent use.
type ShardSet struct {
	cli  *clientv3.Client
	opts ShardOptions // defaults applied
	log  *slog.Logger
	pool *ElectionPool
	w    *HostWatcher

	// ctx is the shard set's life: its cause is ErrClosed after Close,
	// ErrClientClosed once the client is closed.
	ctx      context.Context
	cancel   context.CancelCauseFunc
	starting shardStart
	wg       sync.WaitGroup // the followers, the announcer and the workers
	runs     sync.WaitGroup // the Runs; added to under mu while ctx lives
	ending   shardEnding

	mu      sync.Mutex
	view    shardView
	rank    ranking
	moves   moveBudget // our campaigns to take a shard over from another live member
	hands   moveBudget // our Runs ended for a better-ranked member in line, not resigned yet
	settle  settleState
	member  announcement
	workers map[string]*shardWorker // by shard: the one that campaigns or runs it
	drain   drainState
}

// shardStart is how far a shard set's start has come.
type shardStart struct {
	hostsEnded chan struct{} // closed when the host watcher's events end
	ready      chan struct{} // closed once the hosts, members and candidates are known
	once       sync.Once     // closes ready
}

// shardEnding is what a shard set's end waits for and gives back.
type shardEnding struct {
	once    sync.Once
	leases  sync.WaitGroup // our member sessions' goroutines
	done    chan struct{}  // closed once the set has ended and every Run returned
	unclaim func()         // with Host: gives our member key back to the host (see claim)
}

// drainState is whether we drain, and whether we are idle. Guarded by
// ShardSet.mu.
type drainState struct {
	on   bool
	idle chan struct{} // closed while we have no worker; see Drain
}

// moveBudget counts our moves of one kind in flight (the takeovers, or
// the handoffs), at most MaxMoves, and the shards waiting for a slot (see
// freeSlotLocked). Guarded by ShardSet.mu.
type moveBudget struct {
	inFlight int
	waiting  map[string]bool // shards waiting for a slot
}

// settleState holds the shards we want but wait to campaign for (see
// waitSettleLocked). Guarded by ShardSet.mu.
type settleState struct {
	// joined is when a member last joined the rankings; unsettled holds
	// the shards we want but wait to campaign for until the members are
	// settled, that is, none joined for Settle; timer is the timer that
	// reconciles them then.
	joined       time.Time
	unsettled    map[string]bool
	standbySince map[string]time.Time // when we first waited for a shard's first candidate
	timer        *time.Timer
}

// candidate is a candidacy in a shard's election.
type candidate struct {
	host string // its identity: a HostUUID
	rev  int64  // its create revision: its place in line
}

// Shard is a shard we own, as Run is given it.
type Shard struct {
	Name string
	// Token is the fencing token of this ownership: the create revision
	// of our candidate key in the shard's election. A later ownership of
	// the shard, ours or another member's, has a greater one (on the same
	// etcd: see SignalEtcdReplaced); a resume after a step-down keeps it.
	Token int64
	Guard clientv3.Cmp // a Txn condition that holds only while this ownership lasts
}

// shardWorker campaigns for one shard, and runs it while we own it. There
// is at most one per shard: one Run at a time.
type shardWorker struct {
	name string
	key  string
	log  *slog.Logger

	// Guarded by ShardSet.mu.
	endTerm context.CancelCauseFunc // ends the term: we no longer want the shard
	stopRun context.CancelCauseFunc // ends Run's ctx; nil unless Run runs
	e       *Election               // the election of the Run that runs
	owned   Shard                   // what that Run was given
	move    bool                    // it counts in ShardSet.moves
	hand    bool                    // it counts in ShardSet.hands
	queued  bool                    // its campaign waits in line, or queues again
	requeue bool                    // its term was ended to campaign again once the set is listed again
}

// Why a Run's ctx ended, besides ErrClosed, ErrClientClosed, ErrHostGone
// (the set ended) and a lost leadership: each wraps the sentinel that
// context.Cause of a Run's ctx is documented to wrap.
var (
	errBetterHost     = fmt.Errorf("%w: a better-ranked member is ready to take the shard", ErrRebalanced)
	errNotRanked      = fmt.Errorf("%w: no longer among the shard's candidates", ErrRebalanced)
	errNotLive        = fmt.Errorf("%w: we are not a live member", ErrHostGone)
	errDraining       = ErrDraining
	errRunReturned    = errors.New("the shard's Run returned before its ctx ended")
	errAnnounceFailed = errors.New("member key could not be put")
)

// NewShardSet starts taking part in the shards of opts: it announces us as
// a member, and returns once it knows the live hosts, the members and the
// shards' candidates, within ctx, which bounds that only. The shard set
// lives until Close, until the client (or WatchClient) is closed, or until
// our registration (opts.Host) ends. It checks its options: a nil client is
// ErrNilClient; missing or invalid Shards, Host, Self, Run, Replicas,
// Weight or MaxMoves ErrInvalidShards; a bad prefix ErrInvalidKey; a bad
// TTL ErrInvalidTTL; a negative KeysPerSession ErrInvalidKeysPerSession.
// Nothing is written on bad input.
func NewShardSet(ctx context.Context, cli *clientv3.Client, opts ShardOptions) (*ShardSet, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	// The pool and the watcher check the client, KeysPerSession and
	// HostPrefix; neither writes anything.
	pool, err := NewElectionPool(cli, PoolOptions{TTL: opts.TTL, Identity: opts.Self, Host: opts.Host,
		KeysPerSession: opts.KeysPerSession, Logger: opts.Logger, OnSignal: opts.OnSignal})
	if err != nil {
		return nil, err
	}
	// With Host, one set of a prefix on the host: its candidate keys
	// would be another's.
	unclaim := func() {}
	if h := opts.Host; h != nil {
		if unclaim, err = h.claim(memberKey(opts.Prefix, opts.Self)); err != nil {
			return nil, opErr(fmt.Sprintf("shard set of %q", opts.Self), err)
		}
	}
	// The watcher tells when etcd was replaced: the set asks etcd
	// whether the etcd of its view was (see askReplaced).
	told := make(chan struct{}, 1)
	w, err := NewHostWatcher(context.Background(), cmp.Or(opts.WatchClient, cli), WatcherOptions{Prefix: opts.HostPrefix,
		UnhealthyAfter: opts.TTL, Logger: opts.Logger, OnSignal: func(sig Signal) {
			if sig.Kind == SignalEtcdReplaced {
				select {
				case told <- struct{}{}:
				default: // a word is waiting already
				}
			}
			emit(opts.OnSignal, sig)
		}})
	if err != nil {
		pool.Close()
		unclaim()
		return nil, err
	}
	s := newShardSet(cli, opts, pool, w)
	s.ending.unclaim = unclaim
	s.view.told = told
	if err = s.start(ctx); err == nil {
		s.follow()
		return s, nil
	}
	// Within ctx: a member lease being granted is revoked when it comes
	// (see startSession), without us.
	s.ending.once.Do(func() {
		s.stop(ErrClosed)
		unclaim()
		close(s.ending.done)
	})
	return nil, opErr(fmt.Sprintf("shard set of %q", opts.Self), err)
}

func newShardSet(cli *clientv3.Client, opts ShardOptions, pool *ElectionPool, w *HostWatcher) *ShardSet {
	s := &ShardSet{cli: cli, opts: opts, log: logger(opts.Logger), pool: pool, w: w,
		starting: shardStart{hostsEnded: make(chan struct{}), ready: make(chan struct{})}, member: announcement{reannounce: make(chan struct{}, 1)},
		ending: shardEnding{done: make(chan struct{})}, drain: drainState{idle: closedChan}, workers: map[string]*shardWorker{},
		view: shardView{waits: map[string][]*catchWait{}, asked: map[string]time.Time{}, hosts: map[string]bool{}, members: map[string]ShardMember{},
			cands: map[string]map[string]candidate{}, replaced: newReplacedNote()},
		moves: moveBudget{waiting: map[string]bool{}}, hands: moveBudget{waiting: map[string]bool{}},
		rank:   ranking{order: map[string][]rankedMember{}, ranked: map[string]bool{}, ordered: map[string]ShardMember{}},
		settle: settleState{unsettled: map[string]bool{}, standbySince: map[string]time.Time{}}}
	for _, name := range opts.Shards {
		s.view.cands[name] = map[string]candidate{}
	}
	s.view.awaited = map[string]ShardMember{}
	s.view.awaitEnd = time.AfterFunc(time.Hour, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		clear(s.view.awaited)
		s.rank.refreshed = false // every shard: see waitSettleLocked
		s.refreshLocked()
	})
	s.view.awaitEnd.Stop()
	s.ctx, s.cancel = context.WithCancelCause(context.Background())
	return s
}

// follow ends the set when the client is closed, or when our
// registration (with Host) ends for good. It starts once start is over,
// for end waits for the member sessions that start adds.
func (s *ShardSet) follow() {
	var hostDone <-chan struct{} // nil without Host: never
	if h := s.opts.Host; h != nil {
		hostDone = h.Done()
	}
	go func() {
		select {
		case <-s.cli.Ctx().Done():
			s.end(ErrClientClosed)
		case <-hostDone:
			s.log.Info("coord: shard set: our registration ended, owning nothing", "err", s.opts.Host.Err())
			s.end(ErrHostGone)
		case <-s.ctx.Done():
		}
	}()
}

// start announces us, follows the hosts, the members and the candidates,
// and waits, within ctx, until all are known.
func (s *ShardSet) start(ctx context.Context) error {
	// With Host, our member session ends with ErrHostGone once the
	// registration has ended, and no other can start then (see borrow).
	sess, err := s.memberSession(ctx, nil)
	if err == nil {
		err = s.announce(ctx, sess)
	}
	if err != nil {
		return err
	}
	s.announced(sess)
	s.wg.Add(3)
	go s.keepAnnounced(sess)
	go s.followHosts()
	go s.followCandidates()
	select {
	case <-s.starting.ready:
		return nil
	case <-s.starting.hostsEnded:
		// Our watcher's ctx has not ended: Err says why it did.
		return s.w.Err()
	case <-ctx.Done():
		return ctx.Err()
	}
}

// wantLocked reports whether we want shard: we are a live member, and
// among its candidates, or we run it: an owner keeps its shard until the
// next candidate is in line to take it over (see outranked), so that a
// planned move leaves no gap beyond the handoff.
func (s *ShardSet) wantLocked(shard string) bool {
	if _, live := s.memberLocked(s.opts.Self); !live {
		return false
	}
	if w := s.workers[shard]; w != nil && w.stopRun != nil {
		return true
	}
	return s.rank.ranked[shard]
}

// outranked reports whether one of cands, in line behind our leadership
// of shard with token, ranks before us: we must hand over to it. Those
// ahead in line are gone, whatever cands still says: we would not lead
// otherwise. A candidacy is proof enough that its host is live and among
// the shard's candidates (it would have withdrawn otherwise): our view of
// the members may lag behind it.
func (s *ShardSet) outranked(shard string, token int64, cands map[string]candidate) bool {
	self := s.selfLocked()
	for _, c := range cands {
		if c.rev > token && memberBefore(shard, s.rankOf(c.host), self) {
			return true
		}
	}
	return false
}

// rankOf returns what ranks host: its member record, or the defaults for
// a member not seen yet.
func (s *ShardSet) rankOf(host string) ShardMember {
	if m, _ := s.memberLocked(host); m.HostUUID != "" {
		return m
	}
	return ShardMember{HostUUID: host, Weight: 1}
}

// takeoverLocked reports whether campaigning for shard would take it over
// from another live member, which owns it and ranks after us.
func (s *ShardSet) takeoverLocked(shard string) bool {
	var owner candidate
	for _, c := range s.view.cands[shard] {
		if owner.rev == 0 || c.rev < owner.rev {
			owner = c
		}
	}
	m, live := s.memberLocked(owner.host)
	return owner.rev != 0 && owner.host != s.opts.Self && live && memberBefore(shard, s.selfLocked(), m)
}

// reconcileLocked brings shard's worker in line with the members and the
// candidates: it starts one when we want the shard (a takeover waits for
// a move slot), ends its term when we no longer do, and ends its Run when
// a better-ranked member campaigns. Nothing is decided before all are
// known, nor after the end.
func (s *ShardSet) reconcileLocked(shard string) {
	if !s.view.hostsSynced || !s.view.candsListed || s.ctx.Err() != nil {
		return
	}
	want := s.wantLocked(shard)
	w := s.workers[shard]
	if w == nil && want && !s.followedLocked(shard) {
		return // until its candidates are read: see followShard
	}
	switch {
	case w == nil && want && s.waitSettleLocked(shard):
	case w == nil && want:
		move := s.takeoverLocked(shard)
		if move && s.moves.inFlight >= s.opts.MaxMoves {
			s.moves.waiting[shard] = true
			return
		}
		delete(s.moves.waiting, shard)
		w = &shardWorker{name: shard, key: s.opts.Prefix + shard, log: s.log.With("shard", shard), move: move}
		if move {
			s.moves.inFlight++
		}
		s.startLocked(w)
	case w == nil:
		delete(s.moves.waiting, shard)
		delete(s.hands.waiting, shard)
		delete(s.settle.unsettled, shard)
		delete(s.settle.standbySince, shard)
	case !want:
		if w.endTerm != nil {
			why := s.whyNotLocked()
			w.log.Debug("coord: shard no longer wanted", "why", why)
			w.endTerm(why)
		}
	case w.move && !s.takeoverLocked(shard):
		// Our candidacy is in line behind a better-ranked member now (a
		// drainer handed the shard to the standby ahead of us): a standby
		// takes nothing over, and a slot it kept would keep the takeovers
		// waiting for one from starting, for as long as it stands by.
		s.endMoveLocked(w)
	case w.stopRun != nil && s.outranked(shard, w.owned.Token, s.view.cands[shard]):
		s.handOverLocked(w)
	}
}

// handOverLocked ends the Run of w, which a better-ranked member in line
// behind us is to take over: a planned handoff. At most MaxMoves are in
// flight at once, from their Run's end to our resign (a drain, a member
// joining, move in steps); the others wait for a slot.
func (s *ShardSet) handOverLocked(w *shardWorker) {
	if !w.hand {
		if s.hands.inFlight >= s.opts.MaxMoves {
			s.hands.waiting[w.name] = true
			return
		}
		delete(s.hands.waiting, w.name)
		w.hand = true
		s.hands.inFlight++
	}
	why := errBetterHost
	if s.drain.on {
		why = errDraining
	}
	w.stopRun(why)
}

// waitSettleLocked reports whether shard, which we want, must wait
// before we campaign for it. A shard with candidates in line waits until
// the members have settled: a member joined less than Settle ago (a
// fleet starting, a rolling restart), and more may follow, each moving
// shards again. A shard with no owner is a failover: it never waits for
// joins, whatever members join meanwhile; nor does one whose candidates
// in line are all of members that left (a member closing, its member key
// gone before its candidacies). But if no member campaigns for it and we
// would be a standby of it, we wait until its first candidate is in line,
// for half the TTL at most (a top member that crashed is gone within the
// TTL, and then we rank first), or until we rank first (see
// refreshLocked): else our candidacy, put first (the top member's put is
// slow under a fleet's cold start, or held back by a join it saw), would
// own it only to hand it over. The timer reconciles it then. After etcd
// was replaced, a top member of the old view is awaited for as long as
// its await lasts, the TTL, instead (see awaitLocked): it comes back, and
// campaigns, only once it has found the replacement and listed the new
// etcd, after a pause of its own.
func (s *ShardSet) waitSettleLocked(shard string) bool {
	now := time.Now()
	var wait time.Duration
	if s.campaignedLocked(shard) {
		wait = s.opts.Settle - now.Sub(s.settle.joined)
	} else if top := s.rank.order[shard][0].HostUUID; top != s.opts.Self {
		since, ok := s.settle.standbySince[shard]
		if !ok {
			since = now
			s.settle.standbySince[shard] = now
		}
		if _, awaited := s.view.awaited[top]; awaited {
			return true // until it campaigns, or its await ends: every shard is reconciled then
		}
		wait = s.opts.TTL/2 - now.Sub(since)
	}
	if wait <= 0 {
		delete(s.settle.unsettled, shard)
		delete(s.settle.standbySince, shard)
		return false
	}
	s.settle.unsettled[shard] = true
	if s.settle.timer == nil {
		s.settle.timer = time.AfterFunc(wait, func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			s.settle.timer = nil
			for shard := range s.settle.unsettled {
				s.reconcileLocked(shard)
			}
		})
	}
	return true
}

// campaignedLocked reports whether a member campaigns for shard, or owns
// it. A candidacy without a member key in our view is a leaver's,
// withdrawn soon; or, for a moment, a joiner's whose member key our view
// has not had yet (a member announces itself before it campaigns, but the
// members and each shard's candidates are separate watches): once it
// has, the joiner ranks, and Settle holds the moves it brings.
func (s *ShardSet) campaignedLocked(shard string) bool {
	for _, c := range s.view.cands[shard] {
		_, member := s.view.members[c.host]
		if _, awaited := s.view.awaited[c.host]; member || awaited {
			return true
		}
	}
	return false
}

// whyNotLocked says why we no longer want a shard.
func (s *ShardSet) whyNotLocked() error {
	if _, live := s.memberLocked(s.opts.Self); !live {
		return errNotLive
	}
	if s.drain.on {
		return errDraining
	}
	return errNotRanked
}

// startLocked starts worker w.
func (s *ShardSet) startLocked(w *shardWorker) {
	if len(s.workers) == 0 {
		s.drain.idle = make(chan struct{})
	}
	s.workers[w.name] = w
	s.wg.Add(1)
	go s.work(w)
}

// forgetLocked forgets worker w, whose last term is over.
func (s *ShardSet) forgetLocked(w *shardWorker) {
	delete(s.workers, w.name)
	s.scopeLocked(w.name)
	s.endMoveLocked(w)
	if len(s.workers) == 0 {
		close(s.drain.idle)
	}
}

// endMoveLocked gives back w's move slot, if it holds one, to a shard
// waiting for one.
func (s *ShardSet) endMoveLocked(w *shardWorker) {
	if !w.move {
		return
	}
	w.move = false
	s.freeSlotLocked(&s.moves)
}

// endHandLocked gives back w's handoff slot, if it holds one, to a shard
// waiting for one: its resign is done.
func (s *ShardSet) endHandLocked(w *shardWorker) {
	if !w.hand {
		return
	}
	w.hand = false
	s.freeSlotLocked(&s.hands)
}

// freeSlotLocked gives back one of b's slots, and reconciles the shards
// waiting for one, while there are some free.
func (s *ShardSet) freeSlotLocked(b *moveBudget) {
	b.inFlight--
	for shard := range b.waiting {
		if b.inFlight >= s.opts.MaxMoves {
			return
		}
		delete(b.waiting, shard)
		s.reconcileLocked(shard)
	}
}

// reconcileAllLocked ranks and reconciles every shard, once the hosts,
// the members and the candidates are all known.
func (s *ShardSet) reconcileAllLocked() {
	if !s.view.hostsSynced || !s.view.candsListed {
		return
	}
	s.starting.once.Do(func() { close(s.starting.ready) })
	s.reorderLocked()
	for shard := range s.view.cands {
		s.rank.ranked[shard] = s.rankedLocked(shard)
		s.scopeLocked(shard)
		s.reconcileLocked(shard)
	}
	if s.view.gen != nil {
		s.view.gen.listed = 0 // followed from the listing, or forgotten
	}
	s.rank.refreshed = true
	_, s.rank.selfLive = s.memberLocked(s.opts.Self)
}

// refreshLocked brings the rankings in line with the live members, and
// reconciles the shards whose decision may have changed: every shard when
// we joined or left ourselves; else those we are now among the
// candidates of, or no longer; and those we work on (a member ahead of us
// in line may rank differently). So a
// member's event costs work in proportion to the shards it moves, not to
// every shard.
func (s *ShardSet) refreshLocked() {
	_, live := s.memberLocked(s.opts.Self)
	if !s.rank.refreshed || live != s.rank.selfLive {
		s.reconcileAllLocked()
		return
	}
	if !s.reorderLocked() {
		return
	}
	for shard := range s.view.cands {
		r := s.rankedLocked(shard)
		changed := r != s.rank.ranked[shard]
		s.rank.ranked[shard] = r
		s.scopeLocked(shard) // whether or not we are among its candidates
		if changed {
			s.reconcileLocked(shard)
		}
	}
	for shard := range s.workers {
		s.reconcileLocked(shard)
	}
	// A standby waiting for a shard's first candidate may rank first now
	// (the member it waited for is gone, or ranks after us now that the
	// view has every member): it need not wait any longer.
	for shard := range s.settle.standbySince {
		s.reconcileLocked(shard)
	}
}

// update applies f to the state, then refreshes the shards.
func (s *ShardSet) update(f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f()
	s.refreshLocked()
}

// hostBatch bounds the host events applied before the shards are
// reconciled: a burst (a snapshot, a fleet starting) is one reconcile.
const hostBatch = 1024

// followHosts keeps the set of live hosts from the watcher's events. When
// they end (Close, the client closed, etcd refusing the watch), no host is
// live any more: every shard is let go, and a refusal ends the set.
func (s *ShardSet) followHosts() {
	defer s.wg.Done()
	defer close(s.starting.hostsEnded)
	synced := s.w.Synced()
	for {
		select {
		case ev, ok := <-s.w.Events():
			if !ok {
				s.log.Info("coord: shard set: host watcher ended", "err", s.w.Err())
				s.update(func() { clear(s.view.hosts) })
				if err := s.w.Err(); err != nil {
					go s.end(err)
				}
				return
			}
			s.update(func() { s.noteHostsLocked(ev) })
		case <-synced:
			synced = nil
			s.update(func() { s.view.hostsSynced = true })
		}
	}
}

// noteHostsLocked applies ev, and the events that are ready after it, up
// to hostBatch.
func (s *ShardSet) noteHostsLocked(ev HostEvent) {
	for range hostBatch {
		if ev.Kind == HostDown {
			delete(s.view.hosts, ev.HostUUID)
		} else {
			s.view.hosts[ev.HostUUID] = true
		}
		var ok bool
		select {
		case ev, ok = <-s.w.Events():
		default:
		}
		if !ok {
			return
		}
	}
}

// askReannounceLocked asks keepAnnounced to put our member key again.
func (s *ShardSet) askReannounceLocked() {
	select {
	case s.member.reannounce <- struct{}{}:
	default:
	}
}

// work serves w's shard, one term after another, for as long as we want
// it; each term has an election of its own, closed (which resigns) at its
// end, so that nothing of a shard we do not want stays in the pool.
func (s *ShardSet) work(w *shardWorker) {
	defer s.wg.Done()
	for {
		term, end := s.beginTerm(w)
		if term == nil {
			return
		}
		// The pool fails only when term has ended (its key is ours alone,
		// and the pool is closed after the workers): the next beginTerm
		// sees why.
		if e, err := s.pool.Election(term, w.key); err == nil {
			// Every campaign of the term takes back an ownership that
			// stepped down (see stepped), pending or not when etcd
			// answers again.
			e.c.stepped.keep = true
			e.c.again = func(ctx context.Context) error { return s.askReplaced(ctx, "a campaign queues again") }
			s.serve(w, e, term)
			e.Close()
		}
		end(nil)
	}
}

// beginTerm starts a term of w if we want its shard; else w is forgotten
// and beginTerm returns nil.
func (s *ShardSet) beginTerm(w *shardWorker) (context.Context, context.CancelCauseFunc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.wantLocked(w.name) || s.ctx.Err() != nil || w.requeue {
		s.forgetLocked(w)
		// A campaign cut short when etcd was replaced goes through the
		// rules again: a standby waits for the shard's first candidate.
		s.reconcileLocked(w.name)
		return nil, nil
	}
	term, end := context.WithCancelCause(s.ctx)
	w.endTerm = end
	return term, end
}

// serve campaigns for w's shard, holds it when we win, and resigns after,
// for as long as term lasts. A campaign that fails, or a Run that returned
// on its own, queues again after a pause, so that neither spins.
func (s *ShardSet) serve(w *shardWorker, e *Election, term context.Context) {
	var r retry
	for term.Err() == nil {
		s.setQueued(w, true)
		err := e.Campaign(term, s.opts.Self)
		s.setQueued(w, false)
		if err == nil {
			err = s.hold(w, e, term)
			// Resign, not Close: we may queue again. Bounded on its own:
			// a resign cut short goes on in the background. Not after a
			// step-down: the next campaign takes the shard back.
			stepped := errors.Is(e.Err(), errUnanswered)
			if !stepped {
				ctx, cancel := context.WithTimeout(context.Background(), s.opts.TTL)
				w.log.Debug("coord: shard resigned", "err", e.Resign(ctx))
				cancel()
			}
			s.mu.Lock()
			s.endHandLocked(w)
			s.mu.Unlock()
			if !stepped {
				// As before a campaign queues again (see work): a
				// leadership that ended may have ended with etcd, and
				// would be put again at once on the new one, before
				// we know; in line, the campaign is held if it did.
				s.setQueued(w, true)
				s.askReplaced(term, "a shard's leadership ended")
			}
		}
		if err == nil {
			r = retry{}
		} else if term.Err() == nil {
			w.log.Warn("coord: shard queues again after a pause", "err", err)
			sleep(term, r.next())
		}
	}
}

// setQueued records whether w's campaign waits in line.
func (s *ShardSet) setQueued(w *shardWorker, queued bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	w.queued = queued
}

// hold runs Run from a won campaign until we must let go and Run has
// returned. It returns errRunReturned when Run returned before its ctx
// ended.
func (s *ShardSet) hold(w *shardWorker, e *Election, term context.Context) error {
	ctx, stop, sh, done := s.acquire(w, e, term)
	if ctx == nil {
		return nil
	}
	w.log.Info("coord: shard acquired", "token", sh.Token)
	emit(s.opts.OnSignal, Signal{Kind: SignalShardAcquired, Key: w.key, Host: s.opts.Self,
		Identity: s.opts.Self, Shard: w.name, Token: sh.Token})
	ran := make(chan struct{})
	go func() {
		defer s.runs.Done()
		defer close(ran)
		s.opts.Run(ctx, sh)
	}()
	select {
	case <-ran:
	case <-ctx.Done():
	case <-done:
		stop(e.Err())
	}
	ended := time.Now()
	<-ran
	drain, cause := time.Since(ended), context.Cause(ctx)
	stop(errRunReturned)
	s.mu.Lock()
	w.stopRun = nil
	s.reconcileLocked(w.name) // draining, we want it no more
	s.mu.Unlock()
	w.log.Info("coord: shard released", "token", sh.Token, "drain", drain, "why", cause)
	emit(s.opts.OnSignal, Signal{Kind: SignalShardReleased, Key: w.key, Host: s.opts.Self,
		Identity: s.opts.Self, Shard: w.name, Token: sh.Token, Drain: drain, Err: cause})
	if cause == nil {
		return errRunReturned
	}
	return nil
}

// acquire makes a won campaign our ownership of w's shard, and returns
// Run's ctx (nil if we hand over at once, without Run: the leadership is
// already over, we no longer want the shard, or a better-ranked host is
// in line), its cancel, the Shard and the leadership's Done.
func (s *ShardSet) acquire(w *shardWorker, e *Election, term context.Context) (context.Context, context.CancelCauseFunc, Shard, <-chan struct{}) {
	// Our view of the candidates may lag behind etcd's, which just made
	// us leader: etcd's own list counts too, when it can be read soon (a
	// leadership cut off steps down by two thirds of the TTL anyway). The
	// read is serializable: it only spares a Run that would be handed over
	// at once, nothing is guarded by it, and a linearizable read waits in
	// line behind etcd's writes (at a fleet's cold start, 1.5 s at the
	// median). A member that lags by a few milliseconds delays a handoff
	// to our watch, or costs a campaign.
	ctx, cancel := context.WithTimeout(term, s.opts.TTL/3)
	defer cancel()
	token := e.Token()
	// etcd's list is read while our view catches up: a round trip spared
	// on every handoff.
	type line struct {
		cands map[string]candidate
		at    int64
	}
	read := make(chan line, 1)
	go func() {
		cands, at := s.line(ctx, w.key, false)
		read <- line{cands, at}
	}()
	s.catchUp(term, w.name, e.wonAt())
	l := <-read
	fresh, at := l.cands, l.at
	s.mu.Lock()
	unsure := s.unconfirmedLocked(w.name, token, fresh, at)
	s.mu.Unlock()
	if unsure {
		// Our view has a better-ranked candidate behind us in line that
		// etcd's list, read where it may lag, does not show yet: ask etcd
		// for certain. An etcd that has not reached the candidate's
		// revision replaced the one of our view, which is forgotten at
		// once (see heard): a view of the old etcd would have us hand
		// over to nobody, win again at once, and again, until our token
		// passed its revisions.
		fresh, _ = s.line(ctx, w.key, true)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.endMoveLocked(w) // moved, or handed on at once: either way, not in flight
	done := e.Done()
	sh := Shard{Name: w.name, Token: token, Guard: e.Guard()}
	if sh.Token == 0 || term.Err() != nil || s.outranked(w.name, sh.Token, s.view.cands[w.name]) || s.outranked(w.name, sh.Token, fresh) {
		w.log.Info("coord: shard won, handed over at once", "token", sh.Token)
		return nil, nil, sh, nil
	}
	run, stop := context.WithCancelCause(term)
	w.stopRun, w.e, w.owned = stop, e, sh
	s.runs.Add(1) // term lives: Close has not started waiting for the Runs
	return run, stop, sh, done
}

// line reads the candidates of the shard whose election is key from etcd,
// linearizably or not, and the revision read at: none and 0 if etcd does
// not answer within ctx.
func (s *ShardSet) line(ctx context.Context, key string, linear bool) (map[string]candidate, int64) {
	opts := []clientv3.OpOption{clientv3.WithPrefix()}
	if !linear {
		opts = append(opts, clientv3.WithSerializable())
	}
	var since *markAt
	if linear {
		since = s.view.mark.at()
	}
	cands := map[string]candidate{}
	resp, err := s.cli.Get(ctx, key+"/", opts...)
	if err != nil {
		return cands, 0
	}
	s.heard(resp.Header, since)
	for _, kv := range resp.Kvs {
		cands[string(kv.Key)] = candidate{host: string(kv.Value), rev: kv.CreateRevision}
	}
	return cands, resp.Header.Revision
}

// unconfirmedLocked reports whether our view has a candidate of shard
// that would have us hand over our leadership with token, and that fresh,
// etcd's list read at revision at, does not show: it was read before the
// candidate's revision.
func (s *ShardSet) unconfirmedLocked(shard string, token int64, fresh map[string]candidate, at int64) bool {
	for key, c := range s.view.cands[shard] {
		if _, ok := fresh[key]; !ok && c.rev > at && s.outranked(shard, token, map[string]candidate{key: c}) {
			return true
		}
	}
	return false
}

// Owned returns the shards we own now, sorted by name: those whose Run
// runs on a leadership that is live (judged at the call, as IsLeader). It
// never talks to etcd.
func (s *ShardSet) Owned() []Shard {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Shard
	for _, w := range s.workers {
		if w.stopRun != nil && w.e.IsLeader() {
			out = append(out, w.owned)
		}
	}
	slices.SortFunc(out, func(a, b Shard) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Owner returns the HostUUID of shard's owner, as etcd holds it (the
// identity of its election's leader), or an error wrapping ErrNoLeader
// when there is none. A host that stepped down while cut off may be shown
// until its key goes. After Close it returns ErrClosed, once the client is
// closed ErrClientClosed.
func (s *ShardSet) Owner(ctx context.Context, shard string) (string, error) {
	if err := checkShardName(shard); err != nil {
		return "", err
	}
	what := fmt.Sprintf("owner of shard %q", shard)
	if err := context.Cause(s.ctx); err != nil {
		return "", opErr(what, err)
	}
	ctx, cancel := clientCtx(ctx, s.cli)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.opts.Prefix+shard+"/", clientv3.WithFirstCreate()...)
	if err != nil {
		return "", opErr(what, err)
	}
	if len(resp.Kvs) == 0 {
		return "", opErr(what, ErrNoLeader)
	}
	return string(resp.Kvs[0].Value), nil
}

// Drain hands every shard we own over to its next candidate and takes
// none: we announce that we drain, so that the other members rank us
// last, our standby candidacies are withdrawn, and each Run's ctx ends
// once the shard's next candidate is in line, at most MaxMoves at once
// (ours, from a Run's end to our resign; a candidate that must campaign
// first is bounded by its own MaxMoves too). It returns nil once we own nothing and have no candidacy
// left, or ctx's error, the drain going on. With no other member to take
// a shard, we keep it. Close after Drain hands over nothing more.
func (s *ShardSet) Drain(ctx context.Context) error {
	what := fmt.Sprintf("drain shard set of %q", s.opts.Self)
	s.mu.Lock()
	if err := context.Cause(s.ctx); err != nil {
		s.mu.Unlock()
		return opErr(what, err)
	}
	if !s.drain.on {
		s.drain.on = true
		s.log.Info("coord: shard set: draining")
		s.askReannounceLocked()
		s.reconcileAllLocked()
	}
	idle := s.drain.idle
	s.mu.Unlock()
	if !within(ctx, idle) {
		return opErr(what, ctx.Err())
	}
	return nil
}

// Done returns a channel closed once the shard set has ended (Close, the
// client closed, our registration gone, a refusal) and every Run has
// returned.
func (s *ShardSet) Done() <-chan struct{} { return s.ending.done }

// Err says why the shard set ended: nil while it lives and after Close;
// ErrClientClosed, ErrHostGone, or etcd's refusal to let us watch.
func (s *ShardSet) Err() error {
	select {
	case <-s.ending.done:
	default:
		return nil
	}
	if err := context.Cause(s.ctx); !errors.Is(err, ErrClosed) {
		return err
	}
	return nil
}

// Close ends every Run's ctx (its cause is ErrClosed), stops the host
// watcher, waits for every Run to return, then closes the elections' pool
// and our member session: their revokes take all our candidacies at once
// (the next candidates take over). It waits for the Runs as long as they
// take; the rest is bounded by about one TTL, however etcd answers. It is
// idempotent and returns nil.
func (s *ShardSet) Close() error {
	s.end(ErrClosed)
	return nil
}

// end ends the shard set with cause, as Close says, once.
func (s *ShardSet) end(cause error) {
	s.ending.once.Do(func() {
		s.stop(cause)
		s.ending.leases.Wait()
		s.ending.unclaim()
		close(s.ending.done)
	})
}

// stop ends the Runs, then the rest, with cause.
func (s *ShardSet) stop(cause error) {
	// Under mu: no Run starts once it is cancelled (see acquire).
	s.mu.Lock()
	s.cancel(cause)
	if s.settle.timer != nil {
		s.settle.timer.Stop()
	}
	s.view.awaitEnd.Stop()
	s.mu.Unlock()
	s.w.Close()
	s.runs.Wait()
	s.pool.Close()
	s.wg.Wait()
}

// Healthy returns nil while the shard set follows the hosts (its host
// watcher is healthy, see HostWatcher.Healthy) and the members and
// candidates (its candidate watch runs, or has been listing again for at
// most the TTL), and while etcd answers the renewals of its sessions: the
// one that holds our member key, and those of the shards we campaign for
// or own (judged as ElectionPool.Healthy does). It returns an error saying
// what is wrong and for how long, "closed" after Close, and why the set
// ended once it ended by itself (Err).
func (s *ShardSet) Healthy() error {
	if err := s.health(time.Now()); err != nil {
		return opErr(fmt.Sprintf("shard set of %q", s.opts.Self), err)
	}
	return nil
}

func (s *ShardSet) health(now time.Time) error {
	if s.ctx.Err() != nil {
		if err := context.Cause(s.ctx); !errors.Is(err, ErrClosed) {
			return fmt.Errorf("ended: %w", bare{err})
		}
		return errHClosed
	}
	if err := s.w.health(now); err != nil {
		return fmt.Errorf("hosts not followed: %w", err)
	}
	if replaced := s.view.replaced.get(); replaced != nil {
		return fmt.Errorf("%w; listing the members and candidates again", replaced)
	}
	s.mu.Lock()
	lost, member, announcing := s.view.candsLost, s.member.sess, s.member.announcing
	s.mu.Unlock()
	sessions := []struct {
		what string
		err  error
	}{
		{"member key", judgeSession(member, announcing, s.opts.TTL, now)},
		{"shards", s.pool.health(now)},
	}
	for _, c := range sessions {
		if c.err != nil {
			return fmt.Errorf("%s: %w", c.what, c.err)
		}
	}
	if !lost.IsZero() && now.Sub(lost) > s.opts.TTL {
		return fmt.Errorf("candidate watch broken for %v, listing again", now.Sub(lost).Round(time.Millisecond))
	}
	return nil
}

// candidatesLost records that the candidate watch broke, unless it was
// broken already.
func (s *ShardSet) candidatesLost() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.view.candsLost.IsZero() {
		s.view.candsLost = time.Now()
	}
}
