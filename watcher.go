package coord

import (
	"context"
	"fmt"
	"log/slog"
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
	if opts.Buffer < 0 {
		return nil, fmt.Errorf("%w: %d", ErrInvalidBuffer, opts.Buffer)
	}
	if opts.Buffer == 0 {
		opts.Buffer = DefaultWatcherBuffer
	}
	ctx, cancel := context.WithCancel(ctx)
	w := &HostWatcher{
		cli:    cli,
		prefix: prefix,
		self:   opts.Self,
		log:    logger(opts.Logger).With("prefix", prefix),
		events: make(chan HostEvent, opts.Buffer),
		synced: make(chan struct{}),
		cancel: cancel,
		done:   make(chan struct{}),
		hosts:  map[string]watched{},
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
		out = append(out, h.meta)
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
		queue    []HostEvent
		listed   bool
		syncLeft int // snapshot events not yet sent
		r        retry
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
		queue = append(queue, w.resync(resp.Kvs, resp.Header.Revision)...)
		if !listed {
			listed = true
			syncLeft = w.syncStep(len(queue))
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := w.cli.Watch(wctx, w.prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	deliver:
		for {
			var out chan<- HostEvent
			var next HostEvent
			if len(queue) > 0 {
				out, next = w.events, queue[0]
			}
			select {
			case out <- next:
				queue[0] = HostEvent{}
				queue = queue[1:]
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
func (w *HostWatcher) resync(kvs []*mvccpb.KeyValue, rev int64) []HostEvent {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []HostEvent
	seen := make(map[string]bool, len(kvs))
	for _, kv := range kvs {
		h, ok := w.decode(kv)
		if !ok {
			continue
		}
		seen[h.meta.HostUUID] = true
		out = append(out, w.change(h, rev, true)...)
	}
	var gone []string
	for id := range w.hosts {
		if !seen[id] {
			gone = append(gone, id)
		}
	}
	slices.Sort(gone)
	for _, id := range gone {
		out = append(out, w.remove(id, rev, true)...)
	}
	return out
}

// apply applies one watch event to the view and returns the host events.
func (w *HostWatcher) apply(ev *clientv3.Event) []HostEvent {
	w.mu.Lock()
	defer w.mu.Unlock()
	id := strings.TrimPrefix(string(ev.Kv.Key), w.prefix)
	if ev.Type == mvccpb.DELETE {
		return w.remove(id, ev.Kv.ModRevision, false)
	}
	h, ok := w.decode(ev.Kv)
	if !ok {
		// Not a host (any more): as if deleted.
		return w.remove(id, ev.Kv.ModRevision, false)
	}
	return w.change(h, ev.Kv.ModRevision, false)
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

// change records h and returns what changed. Called with mu held.
func (w *HostWatcher) change(h watched, rev int64, synthetic bool) []HostEvent {
	id := h.meta.HostUUID
	old, had := w.hosts[id]
	w.hosts[id] = h
	ev := HostEvent{Kind: HostUp, HostUUID: id, Metadata: h.meta, Revision: rev, Synthetic: synthetic}
	switch {
	case !had:
		return []HostEvent{ev}
	case old.lease != h.lease:
		down := HostEvent{Kind: HostDown, HostUUID: id, Metadata: old.meta, Revision: rev, Synthetic: synthetic}
		return []HostEvent{down, ev}
	case old.modRev != h.modRev:
		ev.Kind = HostUpdated
		return []HostEvent{ev}
	}
	return nil
}

// remove forgets host id and returns its Down, if it was known. Called with
// mu held.
func (w *HostWatcher) remove(id string, rev int64, synthetic bool) []HostEvent {
	old, had := w.hosts[id]
	if !had {
		return nil
	}
	delete(w.hosts, id)
	return []HostEvent{{Kind: HostDown, HostUUID: id, Metadata: old.meta, Revision: rev, Synthetic: synthetic}}
}
