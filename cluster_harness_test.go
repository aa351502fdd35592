package coord

// The harness of the fault tests of faults_cluster_test.go: recorders of
// a watcher's events and of etcd's history, the replay that checks one
// against the other, and the fence log of competing leaders.

import (
	"context"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// fcCandidate campaigns on e until ctx ends and, while leading, appends to
// the fence log under Guard; it resigns after 20 writes, so that the
// leadership changes hands during the faults too.
func fcCandidate(ctx context.Context, e *Election, id, fence string) {
	for n := 0; ctx.Err() == nil; {
		if err := e.Campaign(ctx, id); err != nil {
			sleep(ctx, 20*time.Millisecond)
			continue
		}
		token, done, guard := e.Token(), e.Done(), e.Guard()
		for term := 0; term < 20 && !isClosed(done); term++ {
			if !sleep(ctx, 10*time.Millisecond) { // pacing
				return
			}
			n++
			// A write may fail or be refused (Guard no longer holds):
			// only what etcd accepted is checked.
			wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			e.cli.Txn(wctx).If(guard).Then(clientv3.OpPut(fmt.Sprintf("%s%s-%06d", fence, id, n), fmt.Sprintf("%s %d", id, token))).Commit()
			cancel()
		}
		rctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		e.Resign(rctx)
		cancel()
	}
}

// fcCheckFence checks that the fence log, in etcd's order, is made of runs
// of one token each, tokens strictly increasing, each token one writer's;
// it returns the number of writes and of tokens.
func fcCheckFence(t *testing.T, cli *clientv3.Client, fence string) (writes, tokens int) {
	t.Helper()
	resp, err := cli.Get(testCtx(t), fence, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByModRevision, clientv3.SortAscend))
	if err != nil {
		t.Fatal(err)
	}
	var last int64
	writer := map[int64]string{}
	for _, kv := range resp.Kvs {
		var id string
		var token int64
		if _, err := fmt.Sscanf(string(kv.Value), "%s %d", &id, &token); err != nil {
			t.Fatalf("fence entry %s = %q: %v", kv.Key, kv.Value, err)
		}
		if w, ok := writer[token]; ok && w != id || !strings.HasPrefix(string(kv.Key), fence+id+"-") {
			t.Fatalf("fence entry %s by %s has token %d, which is %s's", kv.Key, id, token, writer[token])
		}
		writer[token] = id
		switch {
		case token < last:
			t.Fatalf("fence entry %s has token %d after token %d: two leaders at once", kv.Key, token, last)
		case token > last:
			tokens++
			last = token
		}
	}
	return len(resp.Kvs), tokens
}

// fcState describes what etcd holds: its revision, keys and leases.
func fcState(t *testing.T, cli *clientv3.Client) string {
	t.Helper()
	resp, err := cli.Get(testCtx(t), "\x00", clientv3.WithFromKey(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	ls, err := cli.Leases(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, l := range ls.Leases {
		ids = append(ids, hexID(l.ID))
	}
	slices.Sort(ids)
	return fmt.Sprintf("revision %d, %d keys, leases %v", resp.Header.Revision, resp.Count, ids)
}

// fcRecorder consumes a watcher's events in the background, keeping every
// event and the consumer's replica. An event that does not fit the replica
// (Up of a host up, Updated or Down of a host down, Down without the last
// metadata) fails the test.
type fcRecorder struct {
	t       *testing.T
	mu      sync.Mutex
	events  []HostEvent
	times   []time.Time // when each event was received
	replica map[string]HostMetadata
	changed chan struct{} // closed and replaced on each event
}

func fcWatch(t *testing.T, cli *clientv3.Client, opts WatcherOptions) *fcRecorder {
	t.Helper()
	w, err := NewHostWatcher(context.Background(), cli, opts)
	if err != nil {
		t.Fatal(err)
	}
	r := &fcRecorder{t: t, replica: map[string]HostMetadata{}, changed: make(chan struct{})}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ev := range w.Events() {
			r.add(ev)
		}
	}()
	t.Cleanup(func() {
		w.Close()
		<-done
	})
	return r
}

func (r *fcRecorder) add(ev HostEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	old, had := r.replica[ev.HostUUID]
	switch {
	case ev.Kind == HostUp && had:
		r.t.Errorf("Up of %s, already up", ev.HostUUID)
	case ev.Kind != HostUp && !had:
		r.t.Errorf("%v of %s, not up", ev.Kind, ev.HostUUID)
	case ev.Kind == HostDown && !reflect.DeepEqual(old, ev.Metadata):
		r.t.Errorf("Down of %s with %+v, want the last metadata %+v", ev.HostUUID, ev.Metadata, old)
	}
	if ev.Kind == HostDown {
		delete(r.replica, ev.HostUUID)
	} else {
		r.replica[ev.HostUUID] = ev.Metadata
	}
	r.events = append(r.events, ev)
	r.times = append(r.times, time.Now())
	close(r.changed)
	r.changed = make(chan struct{})
}

// at returns when event i was received.
func (r *fcRecorder) at(i int) time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.times[i]
}

func (r *fcRecorder) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.events)
}

// since returns the events from index i on, less the last -j if j < 0.
func (r *fcRecorder) since(i, j int) []HostEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events[i : len(r.events)+j])
}

// until waits until cond holds of the events and returns when the last
// event then known was received.
func (r *fcRecorder) until(t *testing.T, what string, cond func([]HostEvent) bool) time.Time {
	t.Helper()
	deadline := time.After(patience())
	for {
		r.mu.Lock()
		ok, changed := cond(r.events), r.changed
		var last time.Time
		if len(r.times) > 0 {
			last = r.times[len(r.times)-1]
		}
		r.mu.Unlock()
		if ok {
			return last
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("%s: not seen before the deadline; events: %s", what, fcKinds(r.since(0, 0)))
		}
	}
}

// converge waits until the replica equals etcd's hosts under prefix, and
// returns how long that took.
func (r *fcRecorder) converge(t *testing.T, cli *clientv3.Client, prefix string) time.Duration {
	t.Helper()
	start := time.Now()
	deadline := start.Add(patience())
	for {
		truth := truth(t, cli, prefix)
		r.mu.Lock()
		same, changed := maps.EqualFunc(r.replica, truth, func(a, b HostMetadata) bool { return reflect.DeepEqual(a, b) }), r.changed
		replica := slices.Sorted(maps.Keys(r.replica))
		r.mu.Unlock()
		if same {
			return time.Since(start)
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica %v, etcd %v", replica, slices.Sorted(maps.Keys(truth)))
		}
		select { // a new event, or a new look at etcd
		case <-changed:
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// fcQuiet checks that each recorder gets nothing more than the Up and Down
// of a marker host written after everything else; it returns the revision
// of the marker's delete.
func fcQuiet(t *testing.T, cli *clientv3.Client, prefix string, rs ...*fcRecorder) int64 {
	t.Helper()
	marks := make([]int, len(rs))
	for i, r := range rs {
		marks[i] = r.len()
	}
	id := fmt.Sprintf("marker-%d", time.Now().UnixNano())
	if _, err := cli.Put(testCtx(t), prefix+id, fmt.Sprintf(`{"host_uuid":%q}`, id)); err != nil {
		t.Fatal(err)
	}
	del, err := cli.Delete(testCtx(t), prefix+id)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range rs {
		r.until(t, "the marker's Down", func(evs []HostEvent) bool { return fcHas(evs[marks[i]:], HostDown, id) })
		if got, want := fcKinds(r.since(marks[i], 0)), fmt.Sprintf("up %s, down %s", id, id); got != want {
			t.Fatalf("watcher %d: %s, want only %s", i, got, want)
		}
	}
	return del.Header.Revision
}

// fcSnapshot returns the keys under prefix at revision rev.
func fcSnapshot(t *testing.T, cli *clientv3.Client, prefix string, rev int64) []*mvccpb.KeyValue {
	t.Helper()
	resp, err := cli.Get(testCtx(t), prefix, clientv3.WithPrefix(), clientv3.WithRev(rev))
	if err != nil {
		t.Fatal(err)
	}
	return resp.Kvs
}

// fcWatchFrom returns etcd's changes under prefix after revision from, up
// to now.
func fcWatchFrom(t *testing.T, cli *clientv3.Client, prefix string, from int64) []*clientv3.Event {
	t.Helper()
	now, err := cli.Get(testCtx(t), prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	l := fcLogEtcd(t, cli, prefix, from)
	return l.events(t, now.Header.Revision)
}

// fcHistory returns the hosts of a snapshot, and the events the changes
// made since stand for, as a watcher that misses nothing delivers them.
func fcHistory(prefix string, snapshot []*mvccpb.KeyValue, changes []*clientv3.Event) (map[string]HostMetadata, []HostEvent) {
	type state struct {
		meta  HostMetadata
		lease int64
	}
	hosts := map[string]state{}
	initial := map[string]HostMetadata{}
	for _, kv := range snapshot {
		if m, err := decodeHost(prefix, kv.Key, kv.Value); err == nil {
			hosts[m.HostUUID] = state{m, kv.Lease}
			initial[m.HostUUID] = m
		}
	}
	var out []HostEvent
	for _, ev := range changes {
		id := strings.TrimPrefix(string(ev.Kv.Key), prefix)
		old, had := hosts[id]
		m, err := decodeHost(prefix, ev.Kv.Key, ev.Kv.Value)
		rev := ev.Kv.ModRevision
		if ev.Type == mvccpb.DELETE || err != nil {
			if had {
				out = append(out, HostEvent{Kind: HostDown, HostUUID: id, Metadata: old.meta, Revision: rev})
				delete(hosts, id)
			}
			continue
		}
		if had && old.lease != ev.Kv.Lease {
			out = append(out, HostEvent{Kind: HostDown, HostUUID: id, Metadata: old.meta, Revision: rev})
			had = false
		}
		kind := HostUp
		if had {
			kind = HostUpdated
		}
		out = append(out, HostEvent{Kind: kind, HostUUID: id, Metadata: m, Revision: rev})
		hosts[id] = state{m, ev.Kv.Lease}
	}
	return initial, out
}

// fcResync returns, as fcKinds writes them, the events a resync at
// revision rev owes a replica of etcd's state at revision from: per host,
// in HostUUID order, a Down for a host gone, an Up for a host come, a Down
// then an Up for a host registered again under another lease, an Updated
// for a host written since, nothing for a host unchanged.
func fcResync(prefix string, snapshot []*mvccpb.KeyValue, changes []*clientv3.Event, from, rev int64) string {
	type key struct{ lease, modRev int64 }
	stateAt := func(rev int64) map[string]key {
		m := map[string]key{}
		put := func(kv *mvccpb.KeyValue, deleted bool) {
			id := strings.TrimPrefix(string(kv.Key), prefix)
			if _, err := decodeHost(prefix, kv.Key, kv.Value); deleted || err != nil {
				delete(m, id)
			} else {
				m[id] = key{kv.Lease, kv.ModRevision}
			}
		}
		for _, kv := range snapshot {
			put(kv, false)
		}
		for _, ev := range changes {
			if ev.Kv.ModRevision <= rev {
				put(ev.Kv, ev.Type == mvccpb.DELETE)
			}
		}
		return m
	}
	before, after := stateAt(from), stateAt(rev)
	ids := maps.Clone(before)
	maps.Copy(ids, after)
	var s []string
	for _, id := range slices.Sorted(maps.Keys(ids)) {
		b, had := before[id]
		a, has := after[id]
		switch {
		case had && (!has || a.lease != b.lease):
			s = append(s, "down "+id)
			if has {
				s = append(s, "up "+id)
			}
		case has && !had:
			s = append(s, "up "+id)
		case has && a.modRev != b.modRev:
			s = append(s, "updated "+id)
		}
	}
	return strings.Join(s, ", ")
}

// fcEtcdLog records etcd's changes under a prefix as they happen.
type fcEtcdLog struct {
	mu      sync.Mutex
	evs     []*clientv3.Event
	times   []time.Time // when each change was received
	rev     int64       // the revision it has seen up to
	err     error
	changed chan struct{} // closed and replaced on each response
}

// fcLogEtcd starts recording the changes under prefix after revision from;
// the recording ends with the test.
func fcLogEtcd(t *testing.T, cli *clientv3.Client, prefix string, from int64) *fcEtcdLog {
	t.Helper()
	l := &fcEtcdLog{rev: from, changed: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for wr := range cli.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(from+1)) {
			l.mu.Lock()
			if err := wr.Err(); err != nil && l.err == nil {
				l.err = err
			}
			for _, ev := range wr.Events {
				l.evs = append(l.evs, ev)
				l.times = append(l.times, time.Now())
			}
			l.rev = max(l.rev, wr.Header.Revision)
			close(l.changed)
			l.changed = make(chan struct{})
			l.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return l
}

// until waits until cond holds of the log.
func (l *fcEtcdLog) until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(patience())
	for {
		l.mu.Lock()
		ok, err, changed := cond(), l.err, l.changed
		l.mu.Unlock()
		switch {
		case err != nil:
			t.Fatalf("recording etcd's changes: %v", err)
		case ok:
			return
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("etcd's log: %s not seen before the deadline", what)
		}
	}
}

// wait waits until the log has seen revision rev, the revision of a change
// under its prefix.
func (l *fcEtcdLog) wait(t *testing.T, rev int64) {
	t.Helper()
	l.until(t, fmt.Sprintf("revision %d", rev), func() bool { return l.rev >= rev })
}

// events returns the changes up to revision rev, which must be that of a
// change under the prefix.
func (l *fcEtcdLog) events(t *testing.T, rev int64) []*clientv3.Event {
	t.Helper()
	l.wait(t, rev)
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.evs)
}

// putAt returns when the log received the put of key under lease.
func (l *fcEtcdLog) putAt(t *testing.T, key string, lease clientv3.LeaseID) time.Time {
	t.Helper()
	var at time.Time
	l.until(t, fmt.Sprintf("the put of %s under lease %x", key, lease), func() bool {
		for i, ev := range l.evs {
			if ev.Type == mvccpb.PUT && string(ev.Kv.Key) == key && ev.Kv.Lease == int64(lease) {
				at = l.times[i]
				return true
			}
		}
		return false
	})
	return at
}

// fcReplay checks a watcher's events against etcd's history: each live
// event is the next change etcd made (same kind, host, metadata and
// revision), and each resync's synthetic events take the replica to
// etcd's state at their revision; a resync with nothing to report is
// accepted only if the changes it skipped leave the replica as it was.
// It returns the number of resyncs seen.
func fcReplay(t *testing.T, name string, evs []HostEvent, initial map[string]HostMetadata, history []HostEvent) int {
	t.Helper()
	apply := func(m map[string]HostMetadata, ev HostEvent) {
		if ev.Kind == HostDown {
			delete(m, ev.HostUUID)
		} else {
			m[ev.HostUUID] = ev.Metadata
		}
	}
	stateAt := func(rev int64) map[string]HostMetadata {
		m := maps.Clone(initial)
		for _, ev := range history {
			if ev.Revision <= rev {
				apply(m, ev)
			}
		}
		return m
	}
	same := func(a, b map[string]HostMetadata) bool {
		return maps.EqualFunc(a, b, func(x, y HostMetadata) bool { return reflect.DeepEqual(x, y) })
	}
	replica, p, resyncs := maps.Clone(initial), 0, 0
	for i := 0; i < len(evs); {
		ev := evs[i]
		if ev.Synthetic {
			for ; i < len(evs) && evs[i].Synthetic && evs[i].Revision == ev.Revision; i++ {
				apply(replica, evs[i])
			}
			if want := stateAt(ev.Revision); !same(replica, want) {
				t.Fatalf("%s: after the resync at revision %d the replica is %v, etcd's state then %v",
					name, ev.Revision, slices.Sorted(maps.Keys(replica)), slices.Sorted(maps.Keys(want)))
			}
			for p < len(history) && history[p].Revision <= ev.Revision {
				p++
			}
			resyncs++
			continue
		}
		q := slices.IndexFunc(history[p:], func(h HostEvent) bool {
			return h.Kind == ev.Kind && h.HostUUID == ev.HostUUID && h.Revision == ev.Revision && reflect.DeepEqual(h.Metadata, ev.Metadata)
		})
		switch {
		case q < 0:
			t.Fatalf("%s: event %d %+v is not a change etcd made after the last one delivered (%s)", name, i, ev, fcEvent(history, p))
		case q > 0:
			if want := stateAt(ev.Revision - 1); !same(replica, want) {
				t.Fatalf("%s: event %d %+v skips %d changes, from %s", name, i, ev, q, fcEvent(history, p))
			}
			resyncs++
		}
		apply(replica, ev)
		p += q + 1
		i++
	}
	if p != len(history) {
		t.Fatalf("%s: the last %d changes were not delivered, from %s", name, len(history)-p, fcEvent(history, p))
	}
	return resyncs
}

// fcEvent describes event i of evs, if any.
func fcEvent(evs []HostEvent, i int) string {
	if i >= len(evs) {
		return "nothing"
	}
	return fmt.Sprintf("%+v", evs[i])
}

// fcVersions returns, per host, the versions of its Updated events.
func fcVersions(evs []HostEvent) map[string][]int {
	out := map[string][]int{}
	for _, ev := range evs {
		if ev.Kind == HostUpdated {
			v, _ := strconv.Atoi(ev.Metadata.Version)
			out[ev.HostUUID] = append(out[ev.HostUUID], v)
		}
	}
	return out
}

func fcHas(evs []HostEvent, kind HostEventKind, id string) bool {
	return slices.ContainsFunc(evs, func(ev HostEvent) bool { return ev.Kind == kind && ev.HostUUID == id })
}

// fcKinds describes events as "up a, down b".
func fcKinds(evs []HostEvent) string {
	var s []string
	for _, ev := range evs {
		s = append(s, ev.Kind.String()+" "+ev.HostUUID)
	}
	return strings.Join(s, ", ")
}

// fcGet returns the key's state, nil if it does not exist.
func fcGet(t *testing.T, cli *clientv3.Client, key string) *mvccpb.KeyValue {
	t.Helper()
	resp, err := cli.Get(testCtx(t), key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return nil
	}
	return resp.Kvs[0]
}

// fcRenewals records when etcd answered a lease renewal of a client.
type fcRenewals struct {
	mu      sync.Mutex
	at      []time.Time
	changed chan struct{}
}

// fcRenewalClient returns a client made from cfg whose answered lease
// renewals are recorded. It is closed at the end of the test.
func fcRenewalClient(t *testing.T, cfg clientv3.Config) (*clientv3.Client, *fcRenewals) {
	t.Helper()
	r := &fcRenewals{changed: make(chan struct{})}
	cfg.DialOptions = append(slices.Clone(cfg.DialOptions), grpc.WithChainStreamInterceptor(
		func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			s, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil || method != "/etcdserverpb.Lease/LeaseKeepAlive" {
				return s, err
			}
			return &fcKeepAliveStream{ClientStream: s, r: r}, nil
		}))
	c, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, r
}

type fcKeepAliveStream struct {
	grpc.ClientStream
	r *fcRenewals
}

func (s *fcKeepAliveStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if resp, ok := m.(*pb.LeaseKeepAliveResponse); ok && err == nil && resp.TTL > 0 {
		s.r.mu.Lock()
		s.r.at = append(s.r.at, time.Now())
		close(s.r.changed)
		s.r.changed = make(chan struct{})
		s.r.mu.Unlock()
	}
	return err
}

// after waits for the first renewal answered after t0.
func (r *fcRenewals) after(t *testing.T, t0 time.Time) time.Time {
	t.Helper()
	deadline := time.After(patience())
	for {
		r.mu.Lock()
		i, _ := slices.BinarySearchFunc(r.at, t0, time.Time.Compare)
		var at time.Time
		if i < len(r.at) {
			at = r.at[i]
		}
		changed := r.changed
		r.mu.Unlock()
		if !at.IsZero() {
			return at
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatal("no lease renewal answered before the deadline")
		}
	}
}
