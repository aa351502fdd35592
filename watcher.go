package coord

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
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
type HostWatcher struct {
	cli    *clientv3.Client
	prefix string
	self   string
	log    *slog.Logger
	signal func(Signal)
	// maxBacklog bounds the events queued for a consumer, beyond twice
	// the hosts it knows of.
	maxBacklog int

	events chan HostEvent // closed by run when it ends
	synced chan struct{}  // closed by run once the snapshot is in events
	cancel context.CancelFunc
	done   chan struct{} // closed when run returns

	mu    sync.Mutex
	hosts map[string]watched // the current view, without Self
	err   error
}

// watched is what the watcher knows of one host.
type watched struct {
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
	prefix, err := prefixOrDefault(opts.Prefix)
	if err != nil {
		return nil, err
	}
	if opts.Buffer < 0 || opts.MaxBacklog < 0 {
		return nil, fmt.Errorf("%w: Buffer %d, MaxBacklog %d", ErrInvalidBuffer, opts.Buffer, opts.MaxBacklog)
	}
	if opts.Buffer == 0 {
		opts.Buffer = DefaultWatcherBuffer
	}
	if opts.MaxBacklog == 0 {
		opts.MaxBacklog = DefaultMaxBacklog
	}
	ctx, cancel := context.WithCancel(ctx)
	w := &HostWatcher{
		cli:        cli,
		prefix:     prefix,
		self:       opts.Self,
		maxBacklog: opts.MaxBacklog,
		signal:     opts.OnSignal,
		log:        logger(opts.Logger).With("prefix", prefix),
		events:     make(chan HostEvent, opts.Buffer),
		synced:     make(chan struct{}),
		cancel:     cancel,
		done:       make(chan struct{}),
		hosts:      map[string]watched{},
	}
	go w.run(ctx)
	return w, nil
}

// Events returns the stream of host events. run closes it when the watcher
// ends.
func (w *HostWatcher) Events() <-chan HostEvent { return w.events }

// Synced returns a channel closed once the synthetic Up events of the
// initial snapshot have all been sent on Events. If the watcher ends before
// that, Synced stays open and Events closes.
func (w *HostWatcher) Synced() <-chan struct{} { return w.synced }

// Hosts returns the watcher's current view, sorted by HostUUID. It may be
// ahead of the events the consumer has read.
func (w *HostWatcher) Hosts() []HostMetadata {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]HostMetadata, 0, len(w.hosts))
	for _, h := range w.hosts {
		out = append(out, own(h.meta))
	}
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

// queued is an event waiting for the consumer, with the host's state
// after it (zero for Down).
type queued struct {
	ev HostEvent
	h  watched
}

// run lists, then watches, and lists again whenever the watch breaks; it
// delivers the queued events in between.
func (w *HostWatcher) run(ctx context.Context) {
	defer close(w.done)
	defer close(w.events)
	// The etcd client retries a call on a closed client for seconds before
	// failing it: end our calls as soon as the client closes. ctx alone
	// says whether the caller ended the watcher.
	cctx, ccancel := context.WithCancel(ctx)
	defer ccancel()
	defer context.AfterFunc(w.cli.Ctx(), ccancel)()
	var (
		queue     []queued
		delivered = map[string]watched{} // the consumer's replica
		listed    bool
		syncLeft  int // snapshot events not yet sent
		r         retry
	)
	for {
		resp, err := w.cli.Get(cctx, w.prefix, clientv3.WithPrefix())
		if err != nil {
			if w.stop(ctx, err) {
				return
			}
			w.log.Warn("coord: list hosts failed, retrying", "err", err)
			sleep(cctx, r.next())
			continue
		}
		r = retry{}
		rev := resp.Header.Revision
		diffs := w.resync(resp.Kvs, rev)
		queue = append(queue, diffs...)
		if listed {
			emit(w.signal, Signal{Kind: SignalWatcherResync, Key: w.prefix, Count: len(diffs)})
		} else {
			listed = true
			syncLeft = w.syncStep(len(queue))
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := w.cli.Watch(wctx, w.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1))
	deliver:
		for {
			var out chan<- HostEvent
			var next HostEvent
			if len(queue) > 0 {
				out, next = w.events, queue[0].ev
			}
			select {
			case out <- next:
				emit(w.signal, Signal{Kind: SignalEventDelivered, Key: w.prefix, Host: next.HostUUID, Event: next.Kind})
				if next.Kind == HostDown {
					delete(delivered, next.HostUUID)
				} else {
					delivered[next.HostUUID] = queue[0].h
				}
				queue[0] = queued{}
				queue = queue[1:]
				if len(queue) == 0 {
					queue = nil // let go of the array behind a big snapshot
				}
				if syncLeft > 0 {
					syncLeft = w.syncStep(syncLeft - 1)
				}
			case wr, ok := <-wch:
				if !ok || wr.Err() != nil {
					cancel()
					if w.stop(ctx, wr.Err()) {
						return
					}
					w.log.Info("coord: host watch broke, resyncing", "err", wr.Err())
					break deliver
				}
				for _, ev := range wr.Events {
					queue = append(queue, w.apply(ev)...)
				}
				rev = wr.Header.Revision
				if len(queue) > w.maxBacklog+2*len(delivered) {
					// The consumer is far behind: what it needs is the
					// difference between what it has and what is.
					w.log.Info("coord: consumer behind, sending differences", "backlog", len(queue))
					queue = w.catchUp(delivered, rev)
					emit(w.signal, Signal{Kind: SignalWatcherResync, Key: w.prefix, Count: len(queue)})
					if syncLeft > 0 {
						// The snapshot is delivered with the catch-up.
						syncLeft = w.syncStep(len(queue))
					}
				}
			}
		}
	}
}

// stop ends the watcher if err, or the state of ctx and the client, says
// it cannot go on, and reports whether it did.
func (w *HostWatcher) stop(ctx context.Context, err error) bool {
	ferr := fatal(ctx, w.cli, err)
	if ferr == nil {
		return false
	}
	if ferr == ctx.Err() {
		ferr = nil
	} else {
		ferr = fmt.Errorf("coord: watch hosts under %q: %w", w.prefix, ferr)
		w.log.Error("coord: host watcher ended", "err", ferr)
	}
	w.mu.Lock()
	w.err = ferr
	w.mu.Unlock()
	return true
}

// syncStep closes Synced once no snapshot event is left to send.
func (w *HostWatcher) syncStep(left int) int {
	if left == 0 {
		close(w.synced)
	}
	return left
}

// resync replaces the view by a snapshot taken at rev and returns the
// differences as synthetic events.
func (w *HostWatcher) resync(kvs []*mvccpb.KeyValue, rev int64) []queued {
	now := make(map[string]watched, len(kvs))
	for _, kv := range kvs {
		if h, ok := w.decode(kv); ok {
			now[h.meta.HostUUID] = h
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	out := diff(w.hosts, now, rev)
	w.hosts = now
	return out
}

// catchUp returns the synthetic events that take a consumer from what it
// was sent to the current view.
func (w *HostWatcher) catchUp(delivered map[string]watched, rev int64) []queued {
	w.mu.Lock()
	defer w.mu.Unlock()
	return diff(delivered, w.hosts, rev)
}

// diff returns the synthetic events, in HostUUID order, that turn the set
// of hosts from into to.
func diff(from, to map[string]watched, rev int64) []queued {
	ids := make([]string, 0, len(to))
	for id := range to {
		ids = append(ids, id)
	}
	for id := range from {
		if _, ok := to[id]; !ok {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	var out []queued
	for _, id := range ids {
		h, ok := to[id]
		if !ok {
			out = append(out, down(from[id], rev, true))
			continue
		}
		out = append(out, transition(from, h, rev, true)...)
	}
	return out
}

// apply applies one watch event to the view and returns the host events.
func (w *HostWatcher) apply(ev *clientv3.Event) []queued {
	var h watched
	ok := false
	if ev.Type != mvccpb.DELETE {
		h, ok = w.decode(ev.Kv)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if !ok {
		// A value that is not a host (any more) counts as deleted.
		id := strings.TrimPrefix(string(ev.Kv.Key), w.prefix)
		old, had := w.hosts[id]
		if !had {
			return nil
		}
		delete(w.hosts, id)
		return []queued{down(old, ev.Kv.ModRevision, false)}
	}
	out := transition(w.hosts, h, ev.Kv.ModRevision, false)
	w.hosts[h.meta.HostUUID] = h
	return out
}

// decode reads a host from kv; Self and values that are not hosts are
// skipped.
func (w *HostWatcher) decode(kv *mvccpb.KeyValue) (watched, bool) {
	m, err := decodeHost(w.prefix, kv.Key, kv.Value)
	if err != nil {
		w.log.Warn("coord: skipping value that is not a host", "key", string(kv.Key), "err", err)
		return watched{}, false
	}
	if m.HostUUID == w.self {
		return watched{}, false
	}
	return watched{meta: m, lease: kv.Lease, modRev: kv.ModRevision}, true
}

// transition returns the events that take host h's entry in view to h.
func transition(view map[string]watched, h watched, rev int64, synthetic bool) []queued {
	old, had := view[h.meta.HostUUID]
	up := queued{ev: HostEvent{Kind: HostUp, HostUUID: h.meta.HostUUID, Metadata: own(h.meta), Revision: rev, Synthetic: synthetic}, h: h}
	switch {
	case !had:
		return []queued{up}
	case old.lease != h.lease:
		// Another lease: the host registered again.
		return []queued{down(old, rev, synthetic), up}
	case old.modRev != h.modRev:
		up.ev.Kind = HostUpdated
		return []queued{up}
	}
	return nil
}

// down returns the Down event of host h, carrying its last metadata.
func down(h watched, rev int64, synthetic bool) queued {
	return queued{ev: HostEvent{Kind: HostDown, HostUUID: h.meta.HostUUID, Metadata: own(h.meta), Revision: rev, Synthetic: synthetic}}
}

// own returns a copy of m that shares nothing with the watcher's view, so
// that a consumer may change what it receives.
func own(m HostMetadata) HostMetadata {
	m.Labels = maps.Clone(m.Labels)
	return m
}
