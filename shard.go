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

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// ShardSet spreads work, split into named shards, over the live hosts of
// a fleet. Every host ranks each shard's live hosts by rendezvous (highest
// random weight) hashing of the shard name and the HostUUID; the top
// Replicas hosts campaign in the shard's election (at Prefix+name, identity
// Self), and the best-ranked one that campaigns owns the shard: a host
// joining or leaving moves about K/N of K shards, and only to or from it.
//
// While we own a shard, Run runs with its fencing token and Guard. Its ctx
// ends when we must let go (context.Cause says why): a better-ranked host
// is campaigning for the shard, we no longer rank among the top Replicas,
// our leadership ended, Self is no longer live, the client was closed, or
// Close. Once Run returns we resign, and the next candidate, already in
// line, owns the shard: a handoff has no overlap, and a gap of Run's drain
// plus a couple of etcd round trips. A standby better ranked than the
// owner waits for that handoff; it never preempts. A Run that returns
// before its ctx ends gives the shard up the same way; we queue again
// after a pause. If etcd refuses for good to let us watch the hosts
// (permission denied), no host is live to us any more: we own nothing.
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
	ctx        context.Context
	cancel     context.CancelCauseFunc
	stopClient func() bool
	hostsEnded chan struct{} // closed when the host watcher's events end
	ready      chan struct{} // closed once the hosts and the candidates are known
	readyOnce  sync.Once
	wg         sync.WaitGroup // the followers and the workers
	runs       sync.WaitGroup // the Runs; added to under mu while ctx lives
	closeOnce  sync.Once

	mu          sync.Mutex
	live        map[string]bool                 // live hosts, Self included
	cands       map[string]map[string]candidate // by shard, by candidate key
	workers     map[string]*shardWorker         // by shard: the one that campaigns or runs it
	hostsSynced bool
	candsListed bool
}

// candidate is a candidacy in a shard's election.
type candidate struct {
	host string // its identity: a HostUUID
	rev  int64  // its create revision: its place in line
}

// Shard is a shard we own, as Run is given it.
type Shard struct {
	Name  string
	Token int64        // fencing token of this ownership: the election's
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
}

// Why a Run's ctx ended, besides ErrClosed, ErrClientClosed and a lost
// leadership.
var (
	errBetterHost  = errors.New("a better-ranked host is campaigning for the shard")
	errNotRanked   = errors.New("no longer among the top replicas of the shard")
	errNotLive     = errors.New("our host is not live")
	errRunReturned = errors.New("the shard's Run returned before its ctx ended")
)

// NewShardSet starts taking part in the shards of opts. It returns once it
// knows the live hosts and the shards' candidates, within ctx, which bounds
// that only: the shard set lives until Close, or until the client is
// closed. It checks its options: a nil client is ErrNilClient; missing or
// invalid Shards, Self, Run or Replicas ErrInvalidShards; a bad prefix
// ErrInvalidKey; a bad TTL ErrInvalidTTL; a negative KeysPerSession
// ErrInvalidKeysPerSession. Nothing is written on bad input.
func NewShardSet(ctx context.Context, cli *clientv3.Client, opts ShardOptions) (*ShardSet, error) {
	opts, err := shardDefaults(opts)
	if err != nil {
		return nil, err
	}
	// The pool and the watcher check the client, KeysPerSession and
	// HostPrefix; neither writes anything.
	pool, err := NewElectionPool(cli, PoolOptions{TTL: opts.TTL, Identity: opts.Self,
		KeysPerSession: opts.KeysPerSession, Logger: opts.Logger, OnSignal: opts.OnSignal})
	if err != nil {
		return nil, err
	}
	w, err := NewHostWatcher(context.Background(), cli, WatcherOptions{Prefix: opts.HostPrefix,
		Logger: opts.Logger, OnSignal: opts.OnSignal})
	if err != nil {
		pool.Close()
		return nil, err
	}
	s := &ShardSet{cli: cli, opts: opts, log: logger(opts.Logger), pool: pool, w: w,
		hostsEnded: make(chan struct{}), ready: make(chan struct{}),
		live: map[string]bool{}, cands: map[string]map[string]candidate{}, workers: map[string]*shardWorker{}}
	for _, name := range opts.Shards {
		s.cands[name] = map[string]candidate{}
	}
	s.ctx, s.cancel = context.WithCancelCause(context.Background())
	s.stopClient = context.AfterFunc(cli.Ctx(), func() { s.cancel(ErrClientClosed) })
	s.wg.Add(2)
	go s.followHosts()
	go s.followCandidates()
	select {
	case <-s.ready:
		return s, nil
	case <-s.hostsEnded:
		// Our watcher's ctx has not ended: Err says why it did.
		err = w.Err()
	case <-ctx.Done():
		err = ctx.Err()
	}
	s.Close()
	return nil, opErr(fmt.Sprintf("shard set of %q", opts.Self), err)
}

// shardDefaults checks what can be checked of opts without etcd, and
// applies the defaults.
func shardDefaults(o ShardOptions) (ShardOptions, error) {
	if len(o.Shards) == 0 || o.Run == nil || o.Replicas < 0 {
		return o, fmt.Errorf("%w: want Shards, Run and Replicas >= 0", ErrInvalidShards)
	}
	if checkHostUUID(o.Self) != nil {
		return o, fmt.Errorf("%w: Self %q (want a HostUUID: non-empty UTF-8, without \"/\")", ErrInvalidShards, o.Self)
	}
	seen := map[string]bool{}
	for _, name := range o.Shards {
		if err := checkShardName(name); err != nil || seen[name] {
			return o, fmt.Errorf("%w: shard %q (want unique, non-empty, without \"/\")", ErrInvalidShards, name)
		}
		seen[name] = true
	}
	o.Replicas = cmp.Or(o.Replicas, DefaultShardReplicas)
	o.Prefix = cmp.Or(o.Prefix, ShardsPrefix)
	o.HostPrefix = cmp.Or(o.HostPrefix, HostsPrefix)
	// Election keys must be clean, and a shard's candidates must never be
	// read as hosts, nor hosts as candidates.
	if !strings.HasSuffix(o.Prefix, "/") || strings.Contains(o.Prefix, "//") ||
		strings.HasPrefix(o.Prefix, o.HostPrefix) || strings.HasPrefix(o.HostPrefix, o.Prefix) {
		return o, fmt.Errorf("%w: shard prefix %q (want it to end in \"/\", without \"//\", apart from host prefix %q)",
			ErrInvalidKey, o.Prefix, o.HostPrefix)
	}
	ttl, err := ttlOrDefault(o.TTL, DefaultShardTTL)
	o.TTL = ttl
	return o, err
}

// weight is host's rendezvous weight for shard: FNV-1a 64 of shard, a
// zero byte and host, spread by splitmix64's finalizer (FNV alone leaves
// weights of similar names close together). The zero byte keeps ("ab",
// "c") apart from ("a", "bc"). It is wire format, as RankHosts is: it
// must never change.
func weight(shard, host string) uint64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for _, s := range [...]string{shard, "\x00", host} {
		for i := 0; i < len(s); i++ {
			h = (h ^ uint64(s[i])) * prime
		}
	}
	h = (h ^ h>>30) * 0xbf58476d1ce4e5b9
	h = (h ^ h>>27) * 0x94d049bb133111eb
	return h ^ h>>31
}

// RankHosts returns hosts (HostUUIDs) in the order every ShardSet ranks
// them for shard, best first: by rendezvous weight, the highest first,
// then by HostUUID. The top Replicas live hosts campaign for the shard and
// the first of them that campaigns owns it, so any program can tell where
// a shard belongs without asking etcd. hosts is not changed.
//
// The ranking is wire format, shared by every agent of a fleet whatever
// its version: it must never change. Were it to, old and new agents would
// rank differently during a rolling upgrade: more than Replicas hosts
// might campaign for a shard, or none of them.
func RankHosts(shard string, hosts []string) []string {
	out := slices.Clone(hosts)
	slices.SortFunc(out, func(a, b string) int {
		if ranksBefore(shard, a, b) {
			return -1
		}
		return 1
	})
	return out
}

// ranksBefore reports whether host a ranks before host b for shard: by
// weight, highest first, then by HostUUID. Every host ranks alike.
func ranksBefore(shard, a, b string) bool {
	wa, wb := weight(shard, a), weight(shard, b)
	return wa > wb || wa == wb && a < b
}

// wantLocked reports whether we want shard: Self is live and among its
// top Replicas live hosts.
func (s *ShardSet) wantLocked(shard string) bool {
	if !s.live[s.opts.Self] {
		return false
	}
	ahead := 0
	for h := range s.live {
		if ranksBefore(shard, h, s.opts.Self) {
			ahead++
		}
	}
	return ahead < s.opts.Replicas
}

// outranked reports whether one of cands, in line behind our leadership
// of shard with token, ranks before us: we must hand over to it. Those
// ahead in line are gone, whatever cands still says: we would not lead
// otherwise. A candidacy is proof enough that its host is live and ranks
// among the top Replicas (it would have withdrawn otherwise): our view of
// the hosts may lag behind it.
func (s *ShardSet) outranked(shard string, token int64, cands map[string]candidate) bool {
	for _, c := range cands {
		if c.rev > token && ranksBefore(shard, c.host, s.opts.Self) {
			return true
		}
	}
	return false
}

// reconcileLocked brings shard's worker in line with the hosts and the
// candidates: it starts one when we want the shard, ends its term when we
// no longer do, and ends its Run when a better-ranked host campaigns.
// Nothing is decided before both are known, nor after the end.
func (s *ShardSet) reconcileLocked(shard string) {
	if !s.hostsSynced || !s.candsListed || s.ctx.Err() != nil {
		return
	}
	want := s.wantLocked(shard)
	w := s.workers[shard]
	switch {
	case w == nil && want:
		w = &shardWorker{name: shard, key: s.opts.Prefix + shard, log: s.log.With("shard", shard)}
		s.workers[shard] = w
		s.wg.Add(1)
		go s.work(w)
	case w == nil:
	case !want:
		cause := errNotRanked
		if !s.live[s.opts.Self] {
			cause = errNotLive
		}
		if w.endTerm != nil {
			w.endTerm(cause)
		}
	case w.stopRun != nil && s.outranked(shard, w.owned.Token, s.cands[shard]):
		w.stopRun(errBetterHost)
	}
}

// reconcileAllLocked reconciles every shard, once the hosts and the
// candidates are both known.
func (s *ShardSet) reconcileAllLocked() {
	if s.hostsSynced && s.candsListed {
		s.readyOnce.Do(func() { close(s.ready) })
	}
	for shard := range s.cands {
		s.reconcileLocked(shard)
	}
}

// update applies f to the state, then reconciles every shard.
func (s *ShardSet) update(f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f()
	s.reconcileAllLocked()
}

// followHosts keeps the set of live hosts from the watcher's events. When
// they end (Close, the client closed, etcd refusing the watch), no host is
// live any more: every shard is let go.
func (s *ShardSet) followHosts() {
	defer s.wg.Done()
	defer close(s.hostsEnded)
	synced := s.w.Synced()
	for {
		select {
		case ev, ok := <-s.w.Events():
			if !ok {
				s.log.Info("coord: shard set: host watcher ended", "err", s.w.Err())
				s.update(func() { clear(s.live) })
				return
			}
			s.update(func() {
				if ev.Kind == HostDown {
					delete(s.live, ev.HostUUID)
				} else {
					s.live[ev.HostUUID] = true
				}
			})
		case <-synced:
			synced = nil
			s.update(func() { s.hostsSynced = true })
		}
	}
}

// followCandidates keeps every shard's candidates: it lists them, then
// watches, and lists again whenever the watch breaks (compaction, lost
// leader, refusal), until the shard set ends.
func (s *ShardSet) followCandidates() {
	defer s.wg.Done()
	var r retry
	for {
		resp, err := s.cli.Get(s.ctx, s.opts.Prefix, clientv3.WithPrefix())
		if err == nil {
			s.update(func() {
				for shard := range s.cands {
					s.cands[shard] = map[string]candidate{}
				}
				for _, kv := range resp.Kvs {
					s.noteLocked(kv, false)
				}
				s.candsListed = true
			})
			err = s.watchCandidates(resp.Header.Revision+1, &r)
		}
		if s.ctx.Err() != nil {
			return
		}
		s.log.Info("coord: shard set: candidate watch broke, listing again", "err", err)
		sleep(s.ctx, r.next())
	}
}

// watchCandidates applies the candidates' changes from rev on, until the
// watch breaks (its error) or the shard set ends (nil).
func (s *ShardSet) watchCandidates(rev int64, r *retry) error {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(s.ctx))
	defer cancel()
	for wr := range s.cli.Watch(ctx, s.opts.Prefix, clientv3.WithPrefix(), clientv3.WithRev(rev)) {
		if err := wr.Err(); err != nil {
			return err
		}
		*r = retry{}
		s.mu.Lock()
		for _, ev := range wr.Events {
			if shard, ok := s.noteLocked(ev.Kv, ev.Type == mvccpb.DELETE); ok {
				s.reconcileLocked(shard)
			}
		}
		s.mu.Unlock()
	}
	return nil
}

// noteLocked records a candidate key put or deleted, and returns its
// shard; keys that are not candidates of our shards are skipped.
func (s *ShardSet) noteLocked(kv *mvccpb.KeyValue, deleted bool) (string, bool) {
	shard, lease, ok := strings.Cut(strings.TrimPrefix(string(kv.Key), s.opts.Prefix), "/")
	cands, known := s.cands[shard]
	if !ok || !known || strings.Contains(lease, "/") {
		return "", false
	}
	if deleted {
		delete(cands, string(kv.Key))
	} else {
		cands[string(kv.Key)] = candidate{host: string(kv.Value), rev: kv.CreateRevision}
	}
	return shard, true
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
	if !s.wantLocked(w.name) || s.ctx.Err() != nil {
		delete(s.workers, w.name)
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
		err := e.Campaign(term, s.opts.Self)
		if err == nil {
			err = s.hold(w, e, term)
			// Resign, not Close: we may queue again. Bounded on its own:
			// a resign cut short goes on in the background.
			ctx, cancel := context.WithTimeout(context.Background(), s.opts.TTL)
			w.log.Debug("coord: shard resigned", "err", e.Resign(ctx))
			cancel()
		}
		if err == nil {
			r = retry{}
		} else if term.Err() == nil {
			w.log.Warn("coord: shard queues again after a pause", "err", err)
			sleep(term, r.next())
		}
	}
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
	emit(s.opts.OnSignal, Signal{Kind: SignalShardAcquired, Host: s.opts.Self, Key: w.name, Token: sh.Token})
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
	s.mu.Unlock()
	w.log.Info("coord: shard released", "token", sh.Token, "drain", drain, "why", cause)
	emit(s.opts.OnSignal, Signal{Kind: SignalShardReleased, Host: s.opts.Self, Key: w.name, Token: sh.Token, Drain: drain, Err: cause})
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
	// leadership cut off steps down by two thirds of the TTL anyway).
	ctx, cancel := context.WithTimeout(term, s.opts.TTL/3)
	defer cancel()
	fresh := map[string]candidate{}
	if resp, err := s.cli.Get(ctx, w.key+"/", clientv3.WithPrefix()); err == nil {
		for _, kv := range resp.Kvs {
			fresh[string(kv.Key)] = candidate{host: string(kv.Value), rev: kv.CreateRevision}
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	done := e.Done()
	sh := Shard{Name: w.name, Token: e.Token(), Guard: e.Guard()}
	if sh.Token == 0 || term.Err() != nil ||
		s.outranked(w.name, sh.Token, s.cands[w.name]) || s.outranked(w.name, sh.Token, fresh) {
		w.log.Info("coord: shard won, handed over at once", "token", sh.Token)
		return nil, nil, sh, nil
	}
	run, stop := context.WithCancelCause(term)
	w.stopRun, w.e, w.owned = stop, e, sh
	s.runs.Add(1) // term lives: Close has not started waiting for the Runs
	return run, stop, sh, done
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

// Close ends every Run's ctx (its cause is ErrClosed), stops the host
// watcher, waits for every Run to return, then closes the elections' pool:
// its sessions' revokes take all our candidacies at once (the next
// candidates take over). It waits for the Runs as long as they take; the
// rest is bounded by about one TTL, however etcd answers. It is idempotent
// and returns nil.
func (s *ShardSet) Close() error {
	s.closeOnce.Do(func() {
		// Under mu: no Run starts once it is cancelled (see acquire).
		s.mu.Lock()
		s.cancel(ErrClosed)
		s.mu.Unlock()
		s.w.Close()
		s.runs.Wait()
		s.pool.Close()
		s.wg.Wait()
		s.stopClient()
	})
	return nil
}
