package coord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// HostEventKind says what happened to a host.
type HostEventKind int

// The kinds of host events.
const (
	HostUp      HostEventKind = iota // the host appeared (or re-registered under a new lease)
	HostDown                         // the host's key is gone: lease expired or revoked, or key deleted
	HostUpdated                      // the host published new metadata under the same lease
)

// String returns "up", "down" or "updated".
func (k HostEventKind) String() string {
	switch k {
	case HostUp:
		return "up"
	case HostDown:
		return "down"
	case HostUpdated:
		return "updated"
	}
	return fmt.Sprintf("HostEventKind(%d)", int(k))
}

// HostEvent is one change of the set of hosts.
type HostEvent struct {
	Kind     HostEventKind
	HostUUID string
	// Metadata is the host's metadata; on Down, the last metadata seen.
	// Its Labels map is shared with the watcher's view (Hosts) and with
	// the host's other events: read it, but clone it before changing it.
	Metadata HostMetadata
	// Revision is the etcd revision of the change, or of the snapshot for
	// synthetic events.
	Revision int64
	// Synthetic is set on events computed from a snapshot or a resync
	// rather than read from a watch event.
	Synthetic bool
}

// HostWatcher streams the hosts under a prefix: a synthetic Up for each host
// present when it starts, then every change. Applying the events in order
// to a set keeps an exact replica of the hosts registered in etcd. It is
// safe for concurrent use.
//
// A host's metadata is decoded once per version of its key and shared by
// the watcher's view and every event that carries it: the Labels maps it
// hands out (in events and from Hosts) are read-only.
type HostWatcher struct {
	cli    *clientv3.Client
	prefix string
	self   string
	log    *slog.Logger
	signal func(Signal)
	// pageSize bounds the keys of each response of a listing.
	pageSize int
	// maxBacklog bounds the events queued for a consumer, beyond twice
	// the hosts it knows of.
	maxBacklog int

	// events is unbuffered: a send is the consumer's receipt. The
	// outbox is the buffer. Closed by run when it ends.
	events chan HostEvent
	synced chan struct{} // closed by run once the consumer has the snapshot
	filled chan struct{} // closed by run once the view holds the snapshot
	cancel context.CancelFunc
	done   chan struct{} // closed when run returns

	mu sync.Mutex
	// hosts is the current view, without Self. Only run's goroutine
	// changes it, under mu; that goroutine reads it without.
	hosts map[string]*version
	err   error
	// For Healthy: whether the watcher follows etcd, whether it ever
	// listed, since when it has not followed, and when its watch last
	// heard from etcd.
	following, listed bool
	blind, heard      time.Time
	unhealthyAfter    time.Duration
	// replaced says that etcd was found replaced and the watcher lists
	// again; nil once it has.
	replaced error

	// mark follows the etcd we talk to; renew says that the view is of an
	// etcd replaced since: a listing reuses none of it. Only run's
	// goroutine uses renew.
	mark  etcdMark
	renew bool
}

// version is one version of a host's key, decoded once. It never changes:
// the view, the queued events and the events sent share it.
type version struct {
	meta   HostMetadata
	lease  int64
	modRev int64
}

// NewHostWatcher starts watching the hosts under opts.Prefix. ctx bounds the
// watcher's life: Events closes when ctx ends or Close is called, or when
// etcd refuses the watch for good (Err says why). It never blocks on the
// consumer: events queue in memory, in order, until read.
func NewHostWatcher(ctx context.Context, cli *clientv3.Client, opts WatcherOptions) (*HostWatcher, error) {
	if cli == nil {
		return nil, ErrNilClient
	}
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	prefix := opts.Prefix
	ctx, cancel := context.WithCancel(ctx)
	w := &HostWatcher{
		cli:        cli,
		prefix:     prefix,
		self:       opts.Self,
		pageSize:   opts.PageSize,
		maxBacklog: opts.MaxBacklog,
		signal:     opts.OnSignal,
		log:        logger(opts.Logger).With("prefix", prefix),
		events:     make(chan HostEvent),
		synced:     make(chan struct{}),
		filled:     make(chan struct{}),
		cancel:     cancel,
		done:       make(chan struct{}),
		hosts:      map[string]*version{},
		blind:      time.Now(),

		unhealthyAfter: opts.UnhealthyAfter,
	}
	go w.run(ctx)
	return w, nil
}

// Events returns the stream of host events. The channel is unbuffered:
// the events the consumer has not received yet wait in the watcher. run
// closes it when the watcher ends.
func (w *HostWatcher) Events() <-chan HostEvent { return w.events }

// Synced returns a channel closed once the consumer has received every
// synthetic Up of the initial snapshot from Events: a select on both never
// sees Synced while one of them is still to come. It closes just after the
// last of them is received, not with it, and only if the consumer receives
// them: wait for Synced while reading Events, not instead. If the consumer
// fell so far behind meanwhile that it was caught up (see
// WatcherOptions.MaxBacklog), Synced closes once it has received the
// differences that replaced the snapshot's unsent Ups. If the watcher ends
// before that, Synced stays open and Events closes.
func (w *HostWatcher) Synced() <-chan struct{} { return w.synced }

// Listed returns a channel closed once Hosts holds the whole initial
// snapshot, whether or not Events are read: a program that only reads
// Hosts waits on Listed, never on Synced (which waits for the consumer).
// If the watcher ends before its first listing, Listed stays open and
// Events closes.
func (w *HostWatcher) Listed() <-chan struct{} { return w.filled }

// Hosts returns the watcher's current view, sorted by HostUUID. It may be
// ahead of the events the consumer has read. The Labels maps are shared
// with the watcher: read them, but clone one before changing it.
func (w *HostWatcher) Hosts() []HostMetadata {
	w.mu.Lock()
	out := make([]HostMetadata, 0, len(w.hosts))
	for _, v := range w.hosts {
		out = append(out, v.meta)
	}
	w.mu.Unlock()
	slices.SortFunc(out, func(a, b HostMetadata) int { return strings.Compare(a.HostUUID, b.HostUUID) })
	return out
}

// Wait blocks until the watcher's goroutine has exited.
func (w *HostWatcher) Wait() { <-w.done }

// Close stops the watcher and waits for it. It is idempotent and returns nil.
func (w *HostWatcher) Close() error {
	w.cancel()
	<-w.done
	return nil
}

// Err says why Events closed: nil after ctx ended or Close, else the cause.
func (w *HostWatcher) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// run lists, then watches, and lists again whenever the watch breaks,
// after a pause (see relistPause); it sends the queued events meanwhile.
func (w *HostWatcher) run(ctx context.Context) {
	defer close(w.done)
	defer close(w.events)
	// The etcd client retries a call on a closed client for seconds before
	// failing it: end our calls as soon as the client closes. ctx alone
	// says whether the caller ended the watcher.
	cctx, ccancel := clientCtx(ctx, w.cli)
	defer ccancel()
	o := &outbox{unsynced: -1, synced: w.synced}
	var r retry
	for first := true; ; first = false {
		if !first {
			relistPause(cctx, w.cli, w.prefix)
		}
		rev, ok := w.relist(ctx, cctx, o, &r)
		w.follows(ok)
		if !ok || !w.follow(ctx, cctx, o, rev, &r) {
			return
		}
	}
}

// relist lists the hosts until it can, and queues the differences with the
// view. It returns the listing's revision, or false if the watcher ends.
func (w *HostWatcher) relist(ctx, cctx context.Context, o *outbox, r *retry) (int64, bool) {
	compacted := 0 // paged listings in a row compacted away
	for {
		limit := w.pageSize
		if compacted >= compactedListings {
			// One read is never compacted away.
			limit = 0
		}
		s, err := w.list(cctx, limit)
		switch {
		case err == nil:
			queued := len(o.queue)
			o.queue = w.resync(o.queue, s)
			w.renew = false
			if o.unsynced < 0 {
				// The first listing: its events are the snapshot that
				// Synced waits for.
				o.unsynced = len(o.queue)
				o.syncedIf()
				close(w.filled)
			} else {
				emit(w.signal, Signal{Kind: SignalWatcherResync, Key: w.prefix, Count: len(o.queue) - queued})
			}
			return s.rev, true
		case w.endIfFatal(ctx, err):
			return 0, false
		case errors.Is(err, rpctypes.ErrCompacted):
			// A page is read at the first page's revision, which etcd
			// compacted meanwhile: start again, at the latest.
			if compacted++; compacted < compactedListings {
				w.log.Info("coord: listing compacted away, listing again", "err", err)
			} else {
				// etcd compacts faster than the pages come.
				w.log.Warn("coord: paged listing compacted away again and again, listing in one read", "restarts", compacted, "err", err)
				emit(w.signal, Signal{Kind: SignalWatcherListingCompacted, Key: w.prefix, Count: compacted})
			}
		default:
			// The one read may have failed for its size: pages again.
			compacted = 0
			w.log.Warn("coord: list hosts failed, retrying", "err", err)
			sleep(cctx, r.next())
		}
	}
}

// follow watches from rev+1 and sends the queued events, until the watch
// breaks or etcd is found replaced (it returns true: list again; the
// listing reports the replacement) or the watcher ends (false). While it
// watches, probe tells Healthy whether etcd still answers.
func (w *HostWatcher) follow(ctx, cctx context.Context, o *outbox, rev int64, r *retry) bool {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	wch := w.cli.Watch(wctx, w.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1))
	probed := make(chan struct{})
	replaced := make(chan struct{}, 1) // etcd found replaced by the probe
	go func() {
		defer close(probed)
		w.probe(wctx, replaced)
	}()
	defer func() {
		cancel()
		<-probed
	}()
	for {
		out, next := o.next(w.events)
		// A watch ends with ctx, closed or not (see responses).
		var wr clientv3.WatchResponse
		ok := false
		select {
		case out <- next:
			emit(w.signal, Signal{Kind: SignalEventDelivered, Key: w.prefix, Host: next.HostUUID, Event: next.Kind})
			o.sent()
			continue
		case wr, ok = <-wch:
		case <-replaced:
			return true // the listing tells
		case <-ctx.Done():
		}
		if ok && wr.Err() == nil && w.mark.replacedBy(wr.Header, nil) != nil {
			return true // the listing tells
		}
		if !ok || wr.Err() != nil {
			cancel()
			if w.endIfFatal(ctx, wr.Err()) {
				return false
			}
			w.follows(false)
			w.log.Info("coord: host watch broke, resyncing", "err", wr.Err())
			// A watch that breaks again and again without news (a
			// list that works, a watch that fails at once) is retried
			// with backoff.
			sleep(cctx, r.next())
			return true
		}
		*r = retry{}
		w.hears()
		w.update(o, wr)
	}
}

// probe reads from etcd, until ctx ends, whenever the watch has heard
// nothing for a third of UnhealthyAfter: a read etcd answers (with a
// leader, as the watch requires) is word from it. A watch cut off
// silently (etcd stopped, a link that drops everything) looks live, for
// the client dials again without a word to it; Healthy reports a watch
// that has not heard from etcd for UnhealthyAfter. (etcd's progress
// notifications cannot tell: etcd sends none to a watch that starts past
// its revision, as a watch resumed on a quiet prefix does, until the
// next write.) Its answers also tell an etcd replaced under a silent
// watch: the watch resumed on it waits for a revision it has not reached.
func (w *HostWatcher) probe(ctx context.Context, replaced chan<- struct{}) {
	every := max(w.unhealthyAfter/3, minBackoff) // a tiny bound must not spin
	for ctx.Err() == nil {
		if wait := every - w.silentFor(time.Now()); wait > 0 {
			sleep(ctx, wait)
			continue
		}
		pctx, cancel := context.WithTimeout(ctx, every)
		since := w.mark.at()
		resp, err := w.cli.Get(pctx, w.prefix)
		cancel()
		if err != nil {
			sleep(ctx, every) // unanswered: ask again later
			continue
		}
		if w.mark.replacedBy(resp.Header, since) != nil {
			replaced <- struct{}{}
			return
		}
		w.hears()
	}
}

// etcdReplaced reports that etcd was found replaced: the watcher lists
// again at once, reusing nothing of its view, and is unhealthy until it
// has.
func (w *HostWatcher) etcdReplaced(err error) {
	w.renew = true
	w.log.Error("coord: etcd was replaced or restored, listing the hosts again", "err", err)
	w.mu.Lock()
	w.replaced = err
	w.mu.Unlock()
	emit(w.signal, Signal{Kind: SignalEtcdReplaced, Key: w.prefix, Err: err})
}

// update applies a watch response to the view and queues its events; a
// consumer that has fallen too far behind is caught up instead.
func (w *HostWatcher) update(o *outbox, wr clientv3.WatchResponse) {
	for _, ev := range wr.Events {
		o.queue = w.apply(o.queue, ev)
	}
	if len(o.queue) > w.maxBacklog+2*o.replica {
		// What the consumer needs is the difference between what it has
		// and what is.
		w.log.Info("coord: consumer behind, sending differences", "backlog", len(o.queue))
		o.catchUp(w.hosts, wr.Header.Revision)
		emit(w.signal, Signal{Kind: SignalWatcherResync, Key: w.prefix, Count: len(o.queue)})
	}
}

// endIfFatal ends the watcher if err, or the state of ctx and the client, says
// it cannot go on, and reports whether it did.
func (w *HostWatcher) endIfFatal(ctx context.Context, err error) bool {
	if status.Code(err) == codes.ResourceExhausted {
		// Our requests are small: an answer too large for the client, or
		// etcd too busy. Neither is for good: the hosts may shrink.
		err = nil
	}
	ferr := fatal(ctx, w.cli, err)
	if ferr == nil {
		return false
	}
	if ferr == ctx.Err() {
		ferr = nil
	} else {
		ferr = opErr(fmt.Sprintf("watch hosts under %q", w.prefix), ferr)
		w.log.Error("coord: host watcher ended", "err", ferr)
	}
	w.mu.Lock()
	w.err = ferr
	w.mu.Unlock()
	return true
}

// snapshot is a listing of the hosts: all of them at revision rev, in
// HostUUID order (etcd's key order).
type snapshot struct {
	rev   int64
	hosts []*version
}

// list reads the hosts in pages of at most limit keys (0: all in one),
// each read at the revision of the first, so that the listing is one
// snapshot. It asks for the next page before it decodes one: etcd serves
// it meanwhile.
func (w *HostWatcher) list(ctx context.Context, limit int) (*snapshot, error) {
	since := w.mark.at()
	resp, err := w.page(ctx, w.prefix, 0, limit)
	if err != nil {
		return nil, err
	}
	if err := w.mark.see(resp.Header, since); err != nil {
		w.etcdReplaced(err)
	}
	rev := resp.Header.Revision
	s := &snapshot{rev: rev, hosts: make([]*version, 0, resp.Count)}
	for {
		var next chan pageResult
		if resp.More {
			next = make(chan pageResult, 1)
			key := string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
			go func() {
				resp, err := w.page(ctx, key, rev, limit)
				next <- pageResult{resp, err}
			}()
		}
		w.read(s, resp.Kvs)
		if next == nil {
			return s, nil
		}
		r := <-next
		if r.err != nil {
			return nil, r.err
		}
		resp = r.resp
	}
}

// pageResult is the outcome of a page's read.
type pageResult struct {
	resp *clientv3.GetResponse
	err  error
}

// page reads the keys from key to the end of the prefix, at most limit of
// them (0: all), at revision rev (0: the latest).
func (w *HostWatcher) page(ctx context.Context, key string, rev int64, limit int) (*clientv3.GetResponse, error) {
	return w.cli.Get(ctx, key, clientv3.WithRange(clientv3.GetPrefixRangeEnd(w.prefix)),
		clientv3.WithLimit(int64(limit)), clientv3.WithRev(rev))
}

// read adds the hosts of one page to s. A key that has not changed since
// the view took it in keeps the view's version: no need to decode it again.
// Not when the view is of an etcd replaced since: its revisions and leases
// say nothing of the new one's.
func (w *HostWatcher) read(s *snapshot, kvs []*mvccpb.KeyValue) {
	for _, kv := range kvs {
		v := w.hosts[string(w.id(kv.Key))]
		if v == nil || w.renew || v.modRev != kv.ModRevision || v.lease != kv.Lease {
			if v = w.decode(kv); v == nil {
				continue
			}
		}
		s.hosts = append(s.hosts, v)
	}
}

// resync makes snapshot s the view and appends to q the differences with
// the view it replaces, in HostUUID order, as synthetic events.
func (w *HostWatcher) resync(q []pending, s *snapshot) []pending {
	now := make(map[string]*version, len(s.hosts))
	for _, v := range s.hosts {
		now[v.meta.HostUUID] = v
	}
	var gone []*version
	for id, v := range w.hosts {
		if _, ok := now[id]; !ok {
			gone = append(gone, v)
		}
	}
	slices.SortFunc(gone, func(a, b *version) int { return strings.Compare(a.meta.HostUUID, b.meta.HostUUID) })
	if len(w.hosts) == 0 {
		q = slices.Grow(q, len(s.hosts)) // all Ups
	}
	for _, v := range s.hosts {
		for ; len(gone) > 0 && gone[0].meta.HostUUID < v.meta.HostUUID; gone = gone[1:] {
			q = transition(q, gone[0], nil, s.rev, true)
		}
		q = transition(q, w.hosts[v.meta.HostUUID], v, s.rev, true)
	}
	for _, v := range gone {
		q = transition(q, v, nil, s.rev, true)
	}
	w.mu.Lock()
	w.hosts = now
	w.mu.Unlock()
	return q
}

// apply applies one watch event to the view and appends its host events
// to q.
func (w *HostWatcher) apply(q []pending, ev *clientv3.Event) []pending {
	old := w.hosts[string(w.id(ev.Kv.Key))]
	var v *version
	if ev.Type != mvccpb.DELETE {
		// A value that is not a host (any more) counts as deleted.
		v = w.decode(ev.Kv)
	}
	if old == nil && v == nil {
		return q
	}
	w.mu.Lock()
	if v == nil {
		delete(w.hosts, old.meta.HostUUID)
	} else {
		w.hosts[v.meta.HostUUID] = v
	}
	w.mu.Unlock()
	return transition(q, old, v, ev.Kv.ModRevision, false)
}

// id returns the part of a key after the prefix: a host key's HostUUID.
// Every key listed or watched is under the prefix.
func (w *HostWatcher) id(key []byte) []byte { return key[len(w.prefix):] }

// decode reads a host from kv; it returns nil for Self and for a value
// that is not a host.
func (w *HostWatcher) decode(kv *mvccpb.KeyValue) *version {
	m, err := decodeHost(w.prefix, kv.Key, kv.Value)
	if err != nil {
		w.log.Warn("coord: skipping value that is not a host", "key", string(kv.Key), "err", err)
		return nil
	}
	if m.HostUUID == w.self {
		return nil
	}
	return &version{meta: m, lease: kv.Lease, modRev: kv.ModRevision}
}

// pending is an event not sent to the consumer yet.
type pending struct {
	kind HostEventKind
	// v is the host's version after the event; on Down, its last one.
	v *version
	// before is the host's version before the event, nil if it had none.
	before    *version
	rev       int64
	synthetic bool
}

func (p *pending) event() HostEvent {
	return HostEvent{Kind: p.kind, HostUUID: p.v.meta.HostUUID, Metadata: p.v.meta, Revision: p.rev, Synthetic: p.synthetic}
}

// transition appends to q the events that take a host from version from
// to version to, either nil if the host is absent.
func transition(q []pending, from, to *version, rev int64, synthetic bool) []pending {
	switch {
	case from == nil && to == nil:
		return q
	case to == nil:
		return append(q, pending{kind: HostDown, v: from, before: from, rev: rev, synthetic: synthetic})
	case from == nil:
		return append(q, pending{kind: HostUp, v: to, rev: rev, synthetic: synthetic})
	case from.lease != to.lease:
		// Another lease: the host registered again.
		return append(q,
			pending{kind: HostDown, v: from, before: from, rev: rev, synthetic: synthetic},
			pending{kind: HostUp, v: to, rev: rev, synthetic: synthetic})
	case from != to:
		// Another version: changed at another revision, or read from an
		// etcd that replaced the one of from (see HostWatcher.read).
		return append(q, pending{kind: HostUpdated, v: to, before: from, rev: rev, synthetic: synthetic})
	}
	return q
}

// outbox holds what the consumer has not been sent yet: the events, in
// order. The consumer's replica is the view without them: each host's
// first queued event says what the consumer has of it.
type outbox struct {
	queue []pending
	// replica counts the hosts the consumer has once it applies every
	// event sent.
	replica int
	// unsynced counts the events to send before Synced closes: -1 until
	// the first listing, 0 once it is closed. Events is unbuffered: an
	// event sent is an event received.
	unsynced int
	synced   chan struct{}
}

// next returns the channel to send the next event on, with the event; a
// nil channel if there is none.
func (o *outbox) next(events chan HostEvent) (chan<- HostEvent, HostEvent) {
	if len(o.queue) == 0 {
		return nil, HostEvent{}
	}
	return events, o.queue[0].event()
}

// sent drops the first event: the consumer was sent it.
func (o *outbox) sent() {
	switch o.queue[0].kind {
	case HostUp:
		o.replica++
	case HostDown:
		o.replica--
	}
	o.queue[0] = pending{}
	if o.queue = o.queue[1:]; len(o.queue) == 0 {
		o.queue = nil // let go of the array behind a big snapshot
	}
	if o.unsynced > 0 {
		o.unsynced--
		o.syncedIf()
	}
}

// catchUp replaces the queue by the events that take the consumer from
// what it was sent to view, at revision rev. Only the hosts with queued
// events can differ.
func (o *outbox) catchUp(view map[string]*version, rev int64) {
	has := map[string]*version{} // what the consumer has of each
	var ids []string
	for _, p := range o.queue {
		id := p.v.meta.HostUUID
		if _, ok := has[id]; !ok {
			has[id] = p.before
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	var q []pending
	for _, id := range ids {
		q = transition(q, has[id], view[id], rev, true)
	}
	o.queue = q
	if o.unsynced > 0 {
		// The snapshot is delivered with the catch-up.
		o.unsynced = len(q)
		o.syncedIf()
	}
}

// syncedIf closes Synced once no snapshot event is left to send.
func (o *outbox) syncedIf() {
	if o.unsynced == 0 {
		close(o.synced)
	}
}

// Healthy returns nil while the watcher follows etcd: it has listed the
// hosts and its watch runs. Before its first listing, and while it lists
// again after its watch broke, it is healthy for WatcherOptions.
// UnhealthyAfter, then returns an error saying for how long it has not
// followed. A watch that has not heard from etcd for UnhealthyAfter (cut
// off silently: etcd stopped, a partition; see follow) is reported too.
// It returns an error once the watcher ended: "closed" after Close or
// the end of its ctx, else why.
func (w *HostWatcher) Healthy() error {
	what := fmt.Sprintf("host watcher of %q", w.prefix)
	if err := w.health(time.Now()); err != nil {
		return opErr(what, err)
	}
	return nil
}

func (w *HostWatcher) health(now time.Time) error {
	select {
	case <-w.done:
		if err := w.Err(); err != nil {
			return fmt.Errorf("ended: %w", bare{err})
		}
		return errHClosed
	default:
	}
	w.mu.Lock()
	following, since, listed, replaced := w.following, w.blind, w.listed, w.replaced
	w.mu.Unlock()
	if replaced != nil {
		return fmt.Errorf("%w; listing the hosts again", replaced)
	}
	if blind := now.Sub(since); !following && blind > w.unhealthyAfter {
		if !listed {
			return fmt.Errorf("not synced for %v", blind.Round(time.Millisecond))
		}
		return fmt.Errorf("watch broken for %v, listing again", blind.Round(time.Millisecond))
	}
	if silent := w.silentFor(now); silent > w.unhealthyAfter {
		return fmt.Errorf("no word from etcd on the watch for %v", silent.Round(time.Millisecond))
	}
	return nil
}

// silentFor says for how long the watch has not heard from etcd at now
// (0 while the watcher does not follow: its listing is judged instead).
func (w *HostWatcher) silentFor(now time.Time) time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.following {
		return 0
	}
	return now.Sub(w.heard)
}

// hears records that the watch heard from etcd.
func (w *HostWatcher) hears() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.heard = time.Now()
}

// follows records whether the watcher follows etcd (it listed the hosts,
// its watch runs) or since when it has not.
func (w *HostWatcher) follows(ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if ok {
		w.listed, w.heard, w.replaced = true, time.Now(), nil
	} else if w.following {
		w.blind = time.Now()
	}
	w.following = ok
}
