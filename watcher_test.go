package coord

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"

	"github.com/go-coord/coord/coordtest"
)

// TestHostWatcherSnapshot covers the list a watcher starts from, and how it
// hands over to the watch.
func TestHostWatcherSnapshot(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("replays existing hosts as synthetic Up then Synced", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		lease := wtGrant(t, cli)
		var rev int64
		for _, id := range []string{"b", "a", "c"} {
			rev = wtPut(t, cli, prefix, meta(id), lease)
		}
		w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix})
		// Listed, but nothing received yet.
		eventually(t, "the snapshot in Hosts", func() bool { return len(w.Hosts()) == 3 })
		if isClosed(w.Synced()) {
			t.Fatal("Synced closed before the snapshot was received")
		}
		for _, id := range []string{"a", "b", "c"} {
			ev := expect(t, w, HostUp, id)
			if !ev.Synthetic || ev.Revision != rev || !reflect.DeepEqual(ev.Metadata, meta(id)) {
				t.Fatalf("snapshot event %+v, want synthetic at revision %d with %+v", ev, rev, meta(id))
			}
		}
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed after the snapshot")
		}
		quiet(t, cli, w, prefix)
	})

	t.Run("closes Listed once Hosts holds the whole snapshot, for a program that never reads Events", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		const n = 300
		wtPutHosts(t, cli, prefix, wtGrant(t, cli), n)
		// Pages of 7: the listing takes 43 reads; Listed waits for the last.
		w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix, PageSize: 7})
		waitClosed(t, w.Listed(), "Listed")
		if got := len(w.Hosts()); got != n {
			t.Fatalf("Hosts holds %d hosts once Listed closed, want %d", got, n)
		}
		if isClosed(w.Synced()) {
			t.Fatal("Synced closed though no event was read")
		}
		// An empty prefix is listed at once too.
		e := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix + "none/"})
		waitClosed(t, e.Listed(), "Listed of an empty prefix")
	})

	t.Run("closes Synced at once when there are no hosts", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix})
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed")
		}
		if len(w.Events()) != 0 || len(w.Hosts()) != 0 {
			t.Fatalf("events %d, hosts %v: want none", len(w.Events()), w.Hosts())
		}
		quiet(t, cli, w, prefix)
	})

	t.Run("closes Synced only once the consumer has received every Up of the snapshot", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		const n = 300
		wtPutHosts(t, cli, prefix, wtGrant(t, cli), n)
		for i := range 5 {
			w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix})
			// The consumer starts once the watcher has listed: the whole
			// snapshot waits for it. Selecting on both Events and Synced,
			// it must still receive every Up first.
			eventually(t, "the snapshot in Hosts", func() bool { return len(w.Hosts()) == n })
			evs := untilSynced(t, w)
			if len(evs) != n {
				t.Fatalf("watcher %d: Synced seen after %d events, want the %d Ups of the snapshot first", i, len(evs), n)
			}
			r := newWtReplica(t)
			for _, ev := range evs {
				if !ev.Synthetic {
					t.Fatalf("watcher %d: snapshot event %+v not synthetic", i, ev)
				}
				r.apply(ev)
			}
			r.matches(cli, prefix)
			w.Close()
		}
	})

	t.Run("closes Synced only once the consumer has received the catch-up that replaced the snapshot", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		lease := wtGrant(t, cli)
		const n = 200
		for i := range 3 {
			prefix := fmt.Sprintf("%s%d/", prefixFor(t), i)
			wtPutRange(t, cli, prefix, lease, 0, n)
			sig := &signals{}
			w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix, MaxBacklog: 1, OnSignal: sig.hook})
			eventually(t, "the snapshot in Hosts", func() bool { return len(w.Hosts()) == n })
			// Before the consumer reads anything, as many hosts come: the
			// queue, past MaxBacklog, is replaced by the differences with
			// what the consumer has (nothing), and Synced waits for them.
			wtPutRange(t, cli, prefix, lease, n, 2*n)
			eventually(t, "the new hosts in Hosts", func() bool { return len(w.Hosts()) == 2*n })
			sig.waitFor(t, SignalWatcherResync, 1)
			evs := untilSynced(t, w)
			if len(evs) != 2*n {
				t.Fatalf("watcher %d: Synced seen after %d events, want the %d Ups of the catch-up first", i, len(evs), 2*n)
			}
			r := newWtReplica(t)
			for _, ev := range evs {
				if ev.Kind != HostUp || !ev.Synthetic {
					t.Fatalf("watcher %d: catch-up event %+v, want a synthetic Up", i, ev)
				}
				r.apply(ev)
			}
			r.matches(cli, prefix)
			w.Close()
		}
	})

	t.Run("neither loses nor repeats a change between the snapshot and the watch", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		started := make(chan struct{}) // closed after the first writes
		synced := make(chan struct{})  // closed once the watcher has synced
		type result struct {
			puts map[string]int64 // revision of each host's first put
			err  error
		}
		done := make(chan result, 1)
		// The writer never pauses from before the watcher lists until well
		// after its watch has started: some writes land in the snapshot,
		// some between the list and the watch, the rest after both.
		go func() {
			n, last := 0, -1
			puts := map[string]int64{}
			err := func() error {
				for ; n != last; n++ {
					if n == 100 {
						close(started)
					}
					if last < 0 && isClosed(synced) {
						last = n + 100
					}
					id := fmt.Sprintf("h%04d", n)
					resp, err := cli.Put(ctx, prefix+id, wtJSON(meta(id)))
					if err != nil {
						return err
					}
					puts[id] = resp.Header.Revision
					if n%7 == 3 && n/2%10 != 2 { // an update of a host put earlier, not removed
						m := meta(fmt.Sprintf("h%04d", n/2))
						m.Version = fmt.Sprint(n)
						if _, err := cli.Put(ctx, prefix+m.HostUUID, wtJSON(m)); err != nil {
							return err
						}
					}
					if n%10 == 5 { // a removal of a host put earlier: those ending in 2
						if _, err := cli.Delete(ctx, prefix+fmt.Sprintf("h%04d", n-3)); err != nil {
							return err
						}
					}
				}
				return nil
			}()
			done <- result{puts, err}
		}()
		<-started
		w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix})
		r := newWtReplica(t)
		var snapshot int64
		apply := func(ev HostEvent) {
			r.apply(ev)
			if ev.Synthetic {
				snapshot = ev.Revision
			}
		}
		// Synced waits for the consumer: read while waiting for it.
		for _, ev := range untilSynced(t, w) {
			apply(ev)
		}
		close(synced)
		res := <-done
		if res.err != nil {
			t.Fatal(res.err)
		}
		// Everything written before the marker is delivered before it.
		marker := wtPut(t, cli, prefix, meta("zz-marker"), 0)
		for {
			ev := next(t, w)
			apply(ev)
			if ev.Revision == marker && !ev.Synthetic {
				break
			}
		}
		truth := truth(t, cli, prefix)
		if !reflect.DeepEqual(r.hosts, truth) {
			t.Fatalf("replica (%d hosts) differs from etcd (%d hosts)", len(r.hosts), len(truth))
		}
		if !reflect.DeepEqual(w.Hosts(), wtSorted(truth)) {
			t.Fatal("Hosts differs from etcd")
		}
		// Each host put after the snapshot was seen come up, exactly once,
		// even if it is gone again; the replica fails on a second Up.
		var after int
		for id, rev := range res.puts {
			if rev > snapshot {
				after++
				if r.ups[id] != 1 {
					t.Fatalf("host %s put at revision %d after the snapshot at %d: Up %d times, want once", id, rev, snapshot, r.ups[id])
				}
			}
		}
		if snapshot == 0 || after < 100 {
			t.Fatalf("snapshot at %d, %d hosts put after it: the writes did not straddle the snapshot", snapshot, after)
		}
	})

	t.Run("does not block on the consumer with 1000 hosts", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		const n = 1000
		lease := wtGrant(t, cli)
		wtPutHosts(t, cli, prefix, lease, n)
		start := time.Now()
		w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix})
		if d := time.Since(start); d > time.Second*scale {
			t.Fatalf("NewHostWatcher took %v", d)
		}
		// Nobody reads Events, yet the watcher lists, then takes in a live
		// change: its loop is not stuck on the consumer.
		eventually(t, "the snapshot in Hosts", func() bool { return len(w.Hosts()) == n })
		wtPut(t, cli, prefix, meta("late"), lease)
		eventually(t, "the live host in Hosts", func() bool { return len(w.Hosts()) == n+1 })
		seen := map[string]bool{}
		for i := range n {
			ev := next(t, w)
			if ev.Kind != HostUp || !ev.Synthetic || seen[ev.HostUUID] {
				t.Fatalf("event %d: %+v (seen before: %v)", i, ev, seen[ev.HostUUID])
			}
			seen[ev.HostUUID] = true
			if i < n-1 && isClosed(w.Synced()) {
				t.Fatalf("Synced closed with %d snapshot events unread", n-i-1)
			}
		}
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed after 1000 Ups")
		}
		if ev := expect(t, w, HostUp, "late"); ev.Synthetic {
			t.Fatalf("live Up is synthetic: %+v", ev)
		}
	})

	t.Run("lists in pages of PageSize hosts, each read at the first page's revision", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		lease := wtGrant(t, cli)
		wtPutAll(t, cli, prefix, lease, "a", "b", "c", "d", "e", "f", "g")
		e := meta("e")
		e.Version = "2.0"
		var changed int64 // the revision of the changes made between pages
		c, ranges := wtRangeClient(t, srv.ClientConfig(), func(n int) {
			if n != 2 {
				return
			}
			// Between the first page and the second: a host of a later
			// page goes, one comes, one is updated. Read at the first
			// page's revision, the listing sees none of it.
			resp, err := cli.Txn(ctx).Then(clientv3.OpDelete(prefix+"f"),
				clientv3.OpPut(prefix+"cc", wtJSON(meta("cc")), clientv3.WithLease(lease)),
				clientv3.OpPut(prefix+"e", wtJSON(e), clientv3.WithLease(lease))).Commit()
			if err != nil {
				t.Errorf("changing hosts between pages: %v", err)
				return
			}
			atomic.StoreInt64(&changed, resp.Header.Revision)
		})
		w := wtWatch(t, ctx, c, WatcherOptions{Prefix: prefix, PageSize: 3})
		r := newWtReplica(t)
		var snap int64
		for _, id := range []string{"a", "b", "c", "d", "e", "f", "g"} {
			ev := expect(t, w, HostUp, id)
			r.apply(ev)
			if snap == 0 {
				snap = ev.Revision
			}
			if !ev.Synthetic || ev.Revision != snap || !reflect.DeepEqual(ev.Metadata, meta(id)) {
				t.Fatalf("snapshot event %+v, want synthetic at revision %d with %+v", ev, snap, meta(id))
			}
		}
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed")
		}
		rev := atomic.LoadInt64(&changed)
		for _, want := range []struct {
			kind HostEventKind
			m    HostMetadata
		}{{HostDown, meta("f")}, {HostUp, meta("cc")}, {HostUpdated, e}} {
			ev := expect(t, w, want.kind, want.m.HostUUID)
			wtCheck(t, ev, want.m, rev, false)
			r.apply(ev)
		}
		if rev <= snap {
			t.Fatalf("changes at revision %d, not after the snapshot at %d", rev, snap)
		}
		quiet(t, cli, w, prefix)
		r.matches(cli, prefix)
		pages := ranges.list()
		if len(pages) != 3 {
			t.Fatalf("%d Range responses, want 3 pages of 3, 3 and 1 hosts: %+v", len(pages), pages)
		}
		for i, p := range pages {
			more := i < 2
			if p.limit != 3 || p.kvs > 3 || p.more != more || (i > 0 && p.rev != snap) {
				t.Fatalf("page %d: %+v, want at most 3 hosts (limit 3), more %v, read at revision %d", i+1, p, more, snap)
			}
		}
	})

	t.Run("lists again from the first page when a page's revision is compacted away", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		lease := wtGrant(t, cli)
		wtPutAll(t, cli, prefix, lease, "a", "b", "c")
		var compacted int64
		c, ranges := wtRangeClient(t, srv.ClientConfig(), func(n int) {
			if n != 2 {
				return
			}
			// Before the second page: a host comes, and etcd compacts
			// its history up to it, the first page's revision included.
			put, err := cli.Put(ctx, prefix+"b2", wtJSON(meta("b2")), clientv3.WithLease(lease))
			if err == nil {
				_, err = cli.Compact(ctx, put.Header.Revision, clientv3.WithCompactPhysical())
			}
			if err != nil {
				t.Errorf("compacting between pages: %v", err)
				return
			}
			atomic.StoreInt64(&compacted, put.Header.Revision)
		})
		tap, log := newLogTap()
		w := wtWatch(t, ctx, c, WatcherOptions{Prefix: prefix, PageSize: 2, Logger: log})
		rev := int64(0)
		for _, id := range []string{"a", "b", "b2", "c"} {
			ev := expect(t, w, HostUp, id)
			rev = atomic.LoadInt64(&compacted)
			wtCheck(t, ev, meta(id), rev, true)
		}
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed")
		}
		if tap.count("coord: listing compacted away, listing again") != 1 {
			t.Fatal("no record of the listing started again")
		}
		quiet(t, cli, w, prefix)
		// Answered: the first page (the second failed), then the listing
		// again: its first page at the latest revision, its second at that.
		if pages := ranges.list(); len(pages) != 3 || pages[1].rev != 0 || pages[2].rev != rev {
			t.Fatalf("Range responses %+v, want the first page, then two pages, the second read at %d", pages, rev)
		}
	})

	t.Run("lists again in pages after a compaction, reusing what did not change", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		lease := wtGrant(t, cli)
		wtPutAll(t, cli, prefix, lease, "a", "b", "c", "m", "y", "z")
		px := srv.NewProxy(t)
		c, ranges := wtRangeClient(t, px.ClientConfig(), nil)
		w := wtWatch(t, ctx, c, WatcherOptions{Prefix: prefix, PageSize: 2})
		r := newWtReplica(t)
		r.applyNext(w, 6)
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed")
		}
		listed := len(ranges.list())

		// As in the compaction test above: the watch resumes after the
		// compacted revision and breaks; the watcher lists again.
		px.Blackhole()
		m := meta("m")
		m.Version = "2.0"
		wtPut(t, cli, prefix, m, lease)
		wtPut(t, cli, prefix, meta("n"), lease)
		for _, id := range []string{"a", "z"} { // the first and the last go
			if _, err := cli.Delete(ctx, prefix+id); err != nil {
				t.Fatal(err)
			}
		}
		rev := srv.Compact(ctx)
		srv.Stop()
		px.Unblackhole()
		srv.Restart()

		for _, want := range []struct {
			kind HostEventKind
			id   string
		}{{HostDown, "a"}, {HostUpdated, "m"}, {HostUp, "n"}, {HostDown, "z"}} {
			ev := expect(t, w, want.kind, want.id)
			if !ev.Synthetic || ev.Revision != rev {
				t.Fatalf("resync event %+v, want synthetic at revision %d", ev, rev)
			}
			r.apply(ev)
		}
		quiet(t, cli, w, prefix)
		r.matches(cli, prefix)
		// The pause's read of the prefix's own key (see relistPause),
		// then b, c, m, n, y: three pages of at most 2.
		pages := ranges.list()[listed:]
		if len(pages) != 4 || pages[0].limit != 0 || pages[0].kvs != 0 {
			t.Fatalf("the listing again took %d Range responses, want the pause's read of one key, then 3 pages: %+v", len(pages), pages)
		}
		pages = pages[1:]
		for i, p := range pages {
			if p.limit != 2 || p.kvs > 2 || (i > 0 && p.rev != rev) {
				t.Fatalf("page %d of the listing again: %+v, want at most 2 hosts, read at revision %d", i+1, p, rev)
			}
		}
	})

	t.Run("starts many watchers at once on a three-member cluster, each in pages", func(t *testing.T) {
		c := coordtest.NewCluster(t, 3)
		cli := c.Client()
		ctx, prefix := testCtx(t), prefixFor(t)
		const hosts, watchers, page = 300, 12, 40
		lease := wtGrant(t, cli)
		wtPutHosts(t, cli, prefix, lease, hosts)
		truth := truth(t, cli, prefix)
		// Each on its own client: its pages go to any member.
		ws := make([]*HostWatcher, watchers)
		rs := make([]*wtRanges, watchers)
		for i := range ws {
			var cc *clientv3.Client
			cc, rs[i] = wtRangeClient(t, c.ClientConfig(), nil)
			ws[i] = wtWatch(t, ctx, cc, WatcherOptions{Prefix: prefix, PageSize: page})
		}
		var wg sync.WaitGroup
		replicas := make([]map[string]HostMetadata, watchers)
		for i, w := range ws {
			wg.Go(func() {
				replicas[i] = map[string]HostMetadata{}
				for ev := range w.Events() {
					replicas[i][ev.HostUUID] = ev.Metadata
					if len(replicas[i]) == hosts {
						return
					}
				}
			})
		}
		wg.Wait()
		for i, w := range ws {
			if !closedWithin(w.Synced()) {
				t.Fatalf("watcher %d: Synced not closed", i)
			}
			if !reflect.DeepEqual(replicas[i], truth) {
				t.Fatalf("watcher %d: replica of %d hosts differs from etcd's %d", i, len(replicas[i]), len(truth))
			}
			pages := rs[i].list()
			for _, p := range pages {
				if p.kvs > page {
					t.Fatalf("watcher %d: a Range response of %d hosts, over PageSize %d", i, p.kvs, page)
				}
			}
			if len(pages) < hosts/page {
				t.Fatalf("watcher %d: %d Range responses for %d hosts in pages of %d", i, len(pages), hosts, page)
			}
		}
	})
}

// TestHostWatcherEvents covers what each change of etcd is reported as.
func TestHostWatcherEvents(t *testing.T) {
	t.Parallel()
	t.Run("delivers live changes with Synthetic false and the etcd revision", func(t *testing.T) {
		_, cli, ctx, prefix, w := wtSyncedEtcd(t)
		lease := wtGrant(t, cli)

		m := meta("a")
		rev := wtPut(t, cli, prefix, m, lease)
		wtCheck(t, expect(t, w, HostUp, "a"), m, rev, false)

		m.Version = "2.0"
		rev = wtPut(t, cli, prefix, m, lease)
		wtCheck(t, expect(t, w, HostUpdated, "a"), m, rev, false)

		del, err := cli.Delete(ctx, prefix+"a")
		if err != nil {
			t.Fatal(err)
		}
		wtCheck(t, expect(t, w, HostDown, "a"), m, del.Header.Revision, false)
	})

	t.Run("reports a registration's Up, Updated, and Down on Stop", func(t *testing.T) {
		_, cli, ctx, prefix, w := wtSyncedEtcd(t)
		h, err := RegisterHostLiveness(ctx, cli, meta("a"), LivenessOptions{Prefix: prefix, TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Stop(context.Background()) })
		if ev := expect(t, w, HostUp, "a"); ev.Synthetic || !reflect.DeepEqual(ev.Metadata, meta("a")) {
			t.Fatalf("Up %+v", ev)
		}
		m := meta("a")
		m.Version = "2.0"
		if err := h.Update(ctx, m); err != nil {
			t.Fatal(err)
		}
		if ev := expect(t, w, HostUpdated, "a"); !reflect.DeepEqual(ev.Metadata, m) {
			t.Fatalf("Updated carries %+v, want %+v", ev.Metadata, m)
		}
		start := time.Now()
		if err := h.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		ev := expect(t, w, HostDown, "a")
		// Stop revokes: no waiting for the lease to expire.
		if d := time.Since(start); d >= h.TTL()*scale {
			t.Fatalf("Down %v after Stop, not before the TTL %v", d, h.TTL())
		}
		if !reflect.DeepEqual(ev.Metadata, m) {
			t.Fatalf("Down carries %+v, want the last metadata %+v", ev.Metadata, m)
		}
		if len(w.Hosts()) != 0 {
			t.Fatalf("Hosts %v after Down", w.Hosts())
		}
	})

	t.Run("reports a crashed registration Down with its metadata after the TTL", func(t *testing.T) {
		srv, _, ctx, prefix, w := wtSyncedEtcd(t)
		agent := srv.NewClient(t)
		h, err := RegisterHostLiveness(ctx, agent, meta("a"), LivenessOptions{Prefix: prefix, TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		// Its client is closed: no revoke to wait for, only goroutines.
		t.Cleanup(func() {
			gone, cancel := context.WithCancel(context.Background())
			cancel()
			h.Stop(gone)
		})
		expect(t, w, HostUp, "a")
		// The agent dies: its lease is neither renewed nor revoked.
		crash := time.Now()
		agent.Close()
		ev := expect(t, w, HostDown, "a")
		// The last renewal was at most a third of the TTL before the crash.
		if d := time.Since(crash); d < h.TTL()/2 {
			t.Fatalf("Down %v after the crash: the lease cannot have expired", d)
		}
		if ev.Synthetic || !reflect.DeepEqual(ev.Metadata, meta("a")) {
			t.Fatalf("Down %+v, want the host's metadata", ev)
		}
	})

	t.Run("reports Down with the last metadata seen, also after an Updated", func(t *testing.T) {
		_, cli, ctx, prefix, w := wtSyncedEtcd(t)
		lease := wtGrant(t, cli)
		m := meta("a")
		wtPut(t, cli, prefix, m, lease)
		expect(t, w, HostUp, "a")
		for _, v := range []string{"2", "3"} {
			m.Version = v
			m.Labels = map[string]string{"v": v}
			wtPut(t, cli, prefix, m, lease)
			expect(t, w, HostUpdated, "a")
		}
		// The lease's end deletes the key: the Down has no value of its own.
		if _, err := cli.Revoke(ctx, lease); err != nil {
			t.Fatal(err)
		}
		if ev := expect(t, w, HostDown, "a"); !reflect.DeepEqual(ev.Metadata, m) {
			t.Fatalf("Down carries %+v, want %+v", ev.Metadata, m)
		}
	})

	t.Run("reports a re-registration under a new lease as Down then Up", func(t *testing.T) {
		_, cli, ctx, prefix, w := wtSyncedEtcd(t)
		old, m := meta("a"), meta("a")
		m.StartedAt = 42
		wtPut(t, cli, prefix, old, wtGrant(t, cli))
		expect(t, w, HostUp, "a")

		// A restart: the key goes, then comes back under another lease.
		if _, err := cli.Delete(ctx, prefix+"a"); err != nil {
			t.Fatal(err)
		}
		wtCheck(t, expect(t, w, HostDown, "a"), old, 0, false)
		rev := wtPut(t, cli, prefix, m, wtGrant(t, cli))
		wtCheck(t, expect(t, w, HostUp, "a"), m, rev, false)

		// A takeover: one put over the key, under another lease.
		m2 := m
		m2.StartedAt = 43
		rev = wtPut(t, cli, prefix, m2, wtGrant(t, cli))
		wtCheck(t, expect(t, w, HostDown, "a"), m, rev, false)
		wtCheck(t, expect(t, w, HostUp, "a"), m2, rev, false)
		quiet(t, cli, w, prefix)
	})

	t.Run("reports a takeover by another agent as Down then Up", func(t *testing.T) {
		srv, cli, ctx, prefix, w := wtSyncedEtcd(t)
		first, second := meta("a"), meta("a")
		second.Hostname = "replacement"
		opts := LivenessOptions{Prefix: prefix, TTL: time.Second}
		h1, err := RegisterHostLiveness(ctx, srv.NewClient(t), first, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h1.Stop(context.Background()) })
		wtCheck(t, expect(t, w, HostUp, "a"), first, 0, false)
		opts.Takeover = true
		h2, err := RegisterHostLiveness(ctx, cli, second, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h2.Stop(context.Background()) })
		down := expect(t, w, HostDown, "a")
		up := expect(t, w, HostUp, "a")
		wtCheck(t, down, first, 0, false)
		wtCheck(t, up, second, down.Revision, false)
		// The first agent gives up instead of fighting back.
		if !closedWithin(h1.Done()) {
			t.Fatal("taken-over registration still running")
		}
		quiet(t, cli, w, prefix)
		if got := w.Hosts(); !reflect.DeepEqual(got, []HostMetadata{second}) {
			t.Fatalf("Hosts %+v, want the new owner's metadata", got)
		}
	})

	t.Run("skips values that are not hosts and reports a host turned garbage Down", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		tap, log := newLogTap()
		put := func(key, val string) {
			t.Helper()
			if _, err := cli.Put(ctx, key, val); err != nil {
				t.Fatal(err)
			}
		}
		put(prefix+"junk", "not json")
		put(prefix+"ok", wtJSON(meta("ok")))
		w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix, Logger: log})
		expect(t, w, HostUp, "ok")
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed")
		}
		if !tap.has("coord: skipping value that is not a host", prefix+"junk") {
			t.Fatalf("no record of the skipped snapshot value; log:\n%s", tap.text())
		}

		put(prefix+"a", wtJSON(meta("a")))
		expect(t, w, HostUp, "a")
		put(prefix+"a", `{"host_uuid":`)
		wtCheck(t, expect(t, w, HostDown, "a"), meta("a"), 0, false)

		// None of these is a host: no event, nothing in Hosts.
		notHosts := map[string]string{
			prefix + "m":   wtJSON(meta("other")), // names another host
			prefix + "x/y": wtJSON(meta("x/y")),   // nested below the prefix
			prefix + "n/o": wtJSON(meta("o")),
			prefix:         `{"host_uuid":""}`, // the prefix key itself
		}
		for k, v := range notHosts {
			put(k, v)
		}
		for k := range notHosts {
			if _, err := cli.Delete(ctx, k); err != nil {
				t.Fatal(err)
			}
		}
		quiet(t, cli, w, prefix)
		for _, k := range append(slices.Collect(maps.Keys(notHosts)), prefix+"a") {
			if !tap.has("coord: skipping value that is not a host", k) {
				t.Errorf("no record of the skipped value at %q; log:\n%s", k, tap.text())
			}
		}
		if got := w.Hosts(); !reflect.DeepEqual(got, []HostMetadata{meta("ok")}) {
			t.Fatalf("Hosts %+v, want only ok", got)
		}
		wtNoErr(t, w)
	})

	t.Run("leaves Self out of events and Hosts", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		lease := wtGrant(t, cli)
		wtPut(t, cli, prefix, meta("me"), lease)
		wtPut(t, cli, prefix, meta("other"), lease)
		w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix, Self: "me"})
		expect(t, w, HostUp, "other")
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed")
		}
		m := meta("me")
		m.Version = "2.0"
		wtPut(t, cli, prefix, m, lease)                         // updated
		wtPut(t, cli, prefix, m, wtGrant(t, cli))               // re-registered
		if _, err := cli.Delete(ctx, prefix+"me"); err != nil { // down
			t.Fatal(err)
		}
		wtPut(t, cli, prefix, meta("me"), lease) // up
		quiet(t, cli, w, prefix)
		if got := w.Hosts(); len(got) != 1 || got[0].HostUUID != "other" {
			t.Fatalf("Hosts %+v, want only other", got)
		}
	})

	t.Run("keeps Hosts sorted by HostUUID and equal to the replica", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		lease := wtGrant(t, cli)
		wtPutAll(t, cli, prefix, lease, "m", "c", "x")
		w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix})
		r := newWtReplica(t)
		r.applyNext(w, 3)
		for _, id := range []string{"q", "a", "z", "b"} {
			wtPut(t, cli, prefix, meta(id), lease)
			r.apply(next(t, w))
		}
		if _, err := cli.Delete(ctx, prefix+"m"); err != nil {
			t.Fatal(err)
		}
		r.apply(next(t, w))
		got := w.Hosts()
		if !slices.IsSortedFunc(got, func(a, b HostMetadata) int { return strings.Compare(a.HostUUID, b.HostUUID) }) {
			t.Fatalf("Hosts not sorted: %v", wtIDs(got))
		}
		if want := wtSorted(r.hosts); !reflect.DeepEqual(got, want) {
			t.Fatalf("Hosts %v, replica %v", wtIDs(got), wtIDs(want))
		}
		if ids := wtIDs(got); !slices.Equal(ids, []string{"a", "b", "c", "q", "x", "z"}) {
			t.Fatalf("Hosts %v", ids)
		}
	})

	t.Run("names the event kinds up, down and updated, and unknown values by number", func(t *testing.T) {
		for k, want := range map[HostEventKind]string{
			HostUp: "up", HostDown: "down", HostUpdated: "updated", HostEventKind(7): "HostEventKind(7)",
		} {
			if got := k.String(); got != want {
				t.Errorf("HostEventKind(%d).String() = %q, want %q", int(k), got, want)
			}
		}
	})
}

// TestHostWatcherFaults covers compaction, a consumer falling behind, an etcd
// restart and unreadable answers.
func TestHostWatcherFaults(t *testing.T) {
	t.Parallel()
	t.Run("after a compaction resyncs and emits only the differences", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		lease := wtGrant(t, cli)
		wtPutAll(t, cli, prefix, lease, "keep", "gone", "upd", "relet")
		px := srv.NewProxy(t)
		tap, log := newLogTap()
		w := wtWatch(t, ctx, px.NewClient(t), WatcherOptions{Prefix: prefix, Logger: log})
		r := newWtReplica(t)
		r.applyNext(w, 4)
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed")
		}

		// Why this forces a resync: the blackhole drops the events etcd
		// sends, so the watcher's client still means to watch from the
		// snapshot's revision+1. On its own, Unblackhole would let the
		// same stream carry on and the dropped events would simply be
		// lost (a proxy artefact: TCP never drops bytes from a live
		// connection). Stopping etcd closes every connection, so the
		// client reconnects and re-creates its watch from that revision,
		// which the compaction has removed: etcd answers ErrCompacted.
		px.Blackhole()
		wtPut(t, cli, prefix, meta("new"), lease)
		if _, err := cli.Delete(ctx, prefix+"gone"); err != nil {
			t.Fatal(err)
		}
		upd, relet := meta("upd"), meta("relet")
		upd.Version, relet.StartedAt = "2.0", 7
		wtPut(t, cli, prefix, upd, lease)
		wtPut(t, cli, prefix, relet, wtGrant(t, cli))
		rev := srv.Compact(ctx)
		// Stopped before Unblackhole, so that no reconnection can start
		// while bytes are still being dropped.
		srv.Stop()
		px.Unblackhole()
		srv.Restart()

		got := map[string]HostEvent{}
		for range 5 {
			ev := next(t, w)
			r.apply(ev)
			if !ev.Synthetic || ev.Revision != rev {
				t.Fatalf("resync event %+v, want synthetic at revision %d", ev, rev)
			}
			got[ev.Kind.String()+" "+ev.HostUUID] = ev
		}
		want := map[string]HostMetadata{
			"up new": meta("new"), "down gone": meta("gone"), "updated upd": upd,
			"down relet": meta("relet"), "up relet": relet,
		}
		for k, m := range want {
			if ev, ok := got[k]; !ok || !reflect.DeepEqual(ev.Metadata, m) {
				t.Fatalf("resync events %v: want %s with %+v", slices.Sorted(maps.Keys(got)), k, m)
			}
		}
		quiet(t, cli, w, prefix) // nothing else, no event for keep
		r.matches(cli, prefix)
		if !tap.has("coord: host watch broke, resyncing", "") || !strings.Contains(tap.text(), rpctypes.ErrCompacted.Error()) {
			t.Fatalf("no record of a resync after ErrCompacted; log:\n%s", tap.text())
		}
	})

	t.Run("catches a consumer behind past MaxBacklog up with a synthetic Down of a host it was sent", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		lease := wtGrant(t, cli)
		wtPutAll(t, cli, prefix, lease, "a", "b", "c")
		sig := &signals{}
		w := wtWatch(t, ctx, cli, WatcherOptions{Prefix: prefix, MaxBacklog: 2, OnSignal: sig.hook})
		r := newWtReplica(t)
		r.applyNext(w, 3)
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed")
		}
		// The consumer, sent Up for a, b and c, reads nothing while one
		// transaction deletes b and brings ten hosts up: one watch
		// response of 11 events, past MaxBacklog plus twice the 3 hosts it
		// was sent, so the queue is replaced by the differences before any
		// of it is sent. b's Down is one of them.
		ops := []clientv3.Op{clientv3.OpDelete(prefix + "b")}
		for i := range 10 {
			id := fmt.Sprintf("y%02d", i)
			ops = append(ops, clientv3.OpPut(prefix+id, wtJSON(meta(id)), clientv3.WithLease(lease)))
		}
		txn, err := cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			t.Fatal(err)
		}
		sig.waitFor(t, SignalWatcherResync, 1)

		// Everything up to a marker written after the catch-up (which may
		// catch the consumer up again, as it is still behind).
		wtPut(t, cli, prefix, meta("zz-marker"), lease)
		var down *HostEvent
		for {
			ev := next(t, w)
			r.apply(ev)
			if ev.Kind == HostDown && ev.HostUUID == "b" {
				down = &ev
			}
			if ev.HostUUID == "zz-marker" {
				break
			}
		}
		r.matches(cli, prefix)
		if down == nil {
			t.Fatal("no Down of b")
		}
		wtCheck(t, *down, meta("b"), 0, true)
		if down.Revision < txn.Header.Revision {
			t.Fatalf("Down of b at revision %d, before its delete at %d", down.Revision, txn.Header.Revision)
		}
		quiet(t, cli, w, prefix)
		wtNoErr(t, w)
	})

	t.Run("keeps running across an etcd restart", func(t *testing.T) {
		srv, cli, ctx, prefix, w := wtSyncedEtcd(t)
		wtPut(t, cli, prefix, meta("a"), 0)
		expect(t, w, HostUp, "a")
		srv.Stop()
		down, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		_, err := cli.Put(down, prefix+"b", wtJSON(meta("b")))
		cancel()
		if err == nil {
			t.Fatal("put succeeded while etcd was stopped")
		}
		srv.Restart()
		rev := wtPut(t, cli, prefix, meta("b"), 0)
		ev := expect(t, w, HostUp, "b")
		// The watch resumes where it was: nothing to resync.
		wtCheck(t, ev, meta("b"), rev, false)
		if _, err := cli.Delete(ctx, prefix+"a"); err != nil {
			t.Fatal(err)
		}
		expect(t, w, HostDown, "a")
		wtNoErr(t, w)
	})

	t.Run("notices an etcd reset, its revisions started over: lists again at once, says so, unhealthy until it has", func(t *testing.T) {
		srv, cli := newEtcd(t)
		w, seen := wtReplacedWatcher(t, cli, time.Second)
		prefix := prefixFor(t)
		// a's put is the first write of each etcd: at the same revision,
		// without a lease, but another value on the new one.
		a := meta("a")
		wtPut(t, cli, prefix, a, 0)
		wtPut(t, cli, prefix, meta("b"), 0)
		r := newWtReplica(t)
		r.applyNext(w, 2)
		wtAheadHeard(t, srv, cli, w)
		srv.Reset()
		a.Version = "2.0"
		wtPut(t, cli, prefix, a, 0)
		wtPut(t, cli, prefix, meta("c"), 0)
		// b down, a updated, c up: in one relisting, the watch left
		// waiting on the old etcd's revisions.
		r.untilMatches(w, cli, prefix)
		seen.check(t, w, prefix)
		quiet(t, cli, w, prefix)
	})

	t.Run("notices an etcd replaced by another cluster from its watch, once its revision passed ours", func(t *testing.T) {
		srv, cli := newEtcd(t)
		// No probe within the test: the watch itself tells.
		w, seen := wtReplacedWatcher(t, cli, time.Hour)
		prefix := prefixFor(t)
		wtPut(t, cli, prefix, meta("a"), 0)
		r := newWtReplica(t)
		r.applyNext(w, 1)
		rev := srv.Revision(testCtx(t))
		srv.Replace()
		wtPut(t, cli, prefix, meta("b"), 0)
		for srv.Revision(testCtx(t)) <= rev+1 {
			wtPut(t, cli, "/elsewhere/", meta("x"), 0)
		}
		wtPut(t, cli, prefix, meta("c"), 0)
		r.untilMatches(w, cli, prefix)
		seen.check(t, w, prefix)
	})

	t.Run("keeps an exact replica across restores from a snapshot: says etcd was replaced when revisions go back, not when the restore bumps them", func(t *testing.T) {
		srv, cli := newEtcd(t)
		w, seen := wtReplacedWatcher(t, cli, time.Second)
		prefix := prefixFor(t)
		r := newWtReplica(t)
		for i, bump := range []uint64{0, 1000} {
			wtPut(t, cli, prefix, meta(fmt.Sprintf("kept-%d", i)), 0)
			r.applyNext(w, 1)
			snap := srv.Snapshot(testCtx(t))
			// Written after the snapshot: gone once it is restored.
			wtPut(t, cli, prefix, meta(fmt.Sprintf("lost-%d", i)), 0)
			r.applyNext(w, 1)
			wtAheadHeard(t, srv, cli, w)
			srv.Restore(snap, bump)
			r.untilMatches(w, cli, prefix)
		}
		// Only the restore without the bump said so; the bumped one was
		// a compaction to the watcher.
		seen.check(t, w, prefix)
	})

	t.Run("syncs though compactions keep cutting its paged listing short", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		const n = 40
		wtPutHosts(t, cli, prefix, wtGrant(t, cli), n)
		// A round trip of some 4 ms: a listing of 40 pages of one host
		// outlasts the 50 ms between compactions.
		px := srv.NewProxy(t)
		px.Delay(2 * time.Millisecond)
		tap, log := newLogTap()
		tap.dumpOnFailure(t)
		sig := &signals{}
		stop := wtCompactEvery(t, cli, strings.TrimSuffix(prefix, "/")+"-tick", 50*time.Millisecond)
		w := wtWatch(t, ctx, px.NewClient(t), WatcherOptions{Prefix: prefix, PageSize: 1, Logger: log, OnSignal: sig.hook})
		r := newWtReplica(t)
		for _, ev := range untilSynced(t, w) {
			r.apply(ev)
		}
		stop()
		r.matches(cli, prefix)
		if len(r.hosts) != n {
			t.Fatalf("%d hosts at Synced, want %d", len(r.hosts), n)
		}
		if s := sig.of(SignalWatcherListingCompacted); len(s) == 0 || s[0].Count != compactedListings || s[0].Key != prefix {
			t.Fatalf("signals %+v, want one of the listing of %q compacted away %d times", s, prefix, compactedListings)
		}
		if !tap.has(wtFallbackMsg, "") {
			t.Fatal("no record of the listing in one read")
		}
		quiet(t, cli, w, prefix)
	})

	t.Run("lists in pages again when its one read fails", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		wtPutHosts(t, cli, prefix, wtGrant(t, cli), 40)
		// As above, on a client that can receive a page of one host but
		// not the 40 in one answer: the one read fails, the listing goes
		// back to pages, which compactions cut short again.
		px := srv.NewProxy(t)
		px.Delay(2 * time.Millisecond)
		cfg := px.ClientConfig()
		cfg.MaxCallRecvMsgSize = 4096
		small, err := clientv3.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { small.Close() })
		tap, log := newLogTap()
		tap.dumpOnFailure(t)
		stop := wtCompactEvery(t, cli, strings.TrimSuffix(prefix, "/")+"-tick", 50*time.Millisecond)
		w := wtWatch(t, ctx, small, WatcherOptions{Prefix: prefix, PageSize: 1, Logger: log})
		tap.wait(t, wtFallbackMsg, 2)
		// Without the compactions, the pages get through.
		stop()
		r := newWtReplica(t)
		for _, ev := range untilSynced(t, w) {
			r.apply(ev)
		}
		r.matches(cli, prefix)
		if !tap.has("coord: list hosts failed, retrying", "") {
			t.Fatal("no record of the one read failing")
		}
	})

	t.Run("retries listing while etcd's answer cannot be read", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		// A client that cannot receive a list of 50 hosts.
		cfg := srv.ClientConfig()
		cfg.MaxCallRecvMsgSize = 4096
		small, err := clientv3.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { small.Close() })
		lease := wtGrant(t, cli)
		for i := range 50 {
			wtPut(t, cli, prefix, meta(fmt.Sprintf("h%02d", i)), lease)
		}
		tap, log := newLogTap()
		w := wtWatch(t, ctx, small, WatcherOptions{Prefix: prefix, Logger: log})
		eventually(t, "a failed list", func() bool { return tap.has("coord: list hosts failed, retrying", "") })
		if isClosed(w.Synced()) {
			t.Fatal("Synced closed without a snapshot")
		}
		// Once the answer fits, the next try gets the snapshot: the 40
		// hosts go in one revision, so that no listing sees some of them
		// (a listing of 30 would be a snapshot of 30 Ups, then Downs).
		var ops []clientv3.Op
		for _, p := range []string{"h1", "h2", "h3", "h4"} {
			ops = append(ops, clientv3.OpDelete(prefix+p, clientv3.WithPrefix()))
		}
		if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
			t.Fatal(err)
		}
		r := newWtReplica(t)
		r.applyNext(w, 10)
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed")
		}
		r.matches(cli, prefix)
		wtNoErr(t, w)
	})
}

// TestHostWatcherLifecycle covers options, defaults and the ways a watcher ends.
func TestHostWatcherLifecycle(t *testing.T) {
	t.Run("Close is idempotent, closes Events and leaves Err nil", func(t *testing.T) {
		_, _, _, _, w := wtSyncedEtcd(t)
		var wg sync.WaitGroup
		errs := make(chan error, 3)
		for range 3 {
			wg.Go(func() { errs <- w.Close() })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("Close: %v", err)
			}
		}
		wtEnded(t, w)
		if err := w.Close(); err != nil {
			t.Fatalf("Close again: %v", err)
		}
		if w.Err() != nil {
			t.Fatalf("Err %v after Close", w.Err())
		}
	})

	t.Run("ending ctx closes Events with Err nil", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx, cancel := context.WithCancel(testCtx(t))
		w := wtSynced(t, ctx, cli, WatcherOptions{Prefix: prefixFor(t)})
		cancel()
		wtEnded(t, w)
		if w.Err() != nil {
			t.Fatalf("Err %v after ctx ended", w.Err())
		}
	})

	t.Run("closing the client closes Events with Err wrapping ErrClientClosed", func(t *testing.T) {
		srv, _ := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		// While watching.
		c := srv.NewClient(t)
		w := wtSynced(t, ctx, c, WatcherOptions{Prefix: prefix})
		c.Close()
		wtEnded(t, w)
		if !errors.Is(w.Err(), ErrClientClosed) {
			t.Fatalf("Err %v, want ErrClientClosed", w.Err())
		}
		// Before the first list: the etcd client would retry the list on
		// its closed connection for 2.5s; the watcher ends at once.
		c = srv.NewClient(t)
		c.Close()
		start := time.Now()
		w = wtWatch(t, ctx, c, WatcherOptions{Prefix: prefix})
		wtEnded(t, w)
		if !errors.Is(w.Err(), ErrClientClosed) {
			t.Fatalf("Err %v, want ErrClientClosed", w.Err())
		}
		if d := time.Since(start); d > time.Second*scale {
			t.Fatalf("ended %v after the start on a closed client", d)
		}
	})

	t.Run("closes Events with Err saying why when etcd refuses for good", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx, prefix := testCtx(t), prefixFor(t)
		for _, step := range []func() error{
			func() error { _, err := cli.RoleAdd(ctx, "root"); return err },
			func() error {
				_, err := cli.UserAddWithOptions(ctx, "root", "", &clientv3.UserAddOptions{NoPassword: true})
				return err
			},
			func() error { _, err := cli.UserGrantRole(ctx, "root", "root"); return err },
			func() error { _, err := cli.UserAdd(ctx, "nobody", "nobody"); return err },
			func() error { _, err := cli.AuthEnable(ctx); return err },
		} {
			if err := step(); err != nil {
				t.Fatal(err)
			}
		}
		cfg := srv.ClientConfig()
		cfg.Username, cfg.Password = "nobody", "nobody"
		c, err := clientv3.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		tap, log := newLogTap()
		w := wtWatch(t, ctx, c, WatcherOptions{Prefix: prefix, Logger: log})
		wtEnded(t, w)
		if !errors.Is(w.Err(), rpctypes.ErrPermissionDenied) || !strings.Contains(w.Err().Error(), prefix) {
			t.Fatalf("Err %v, want permission denied on %q", w.Err(), prefix)
		}
		if isClosed(w.Synced()) {
			t.Fatal("Synced closed without a snapshot")
		}
		if !tap.has("coord: host watcher ended", "") {
			t.Fatalf("no record of the end; log:\n%s", tap.text())
		}
	})

	t.Run("refuses bad options and starts nothing", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		// Once etcd has answered, its own goroutines are all started.
		if _, err := cli.Get(ctx, "x"); err != nil {
			t.Fatal(err)
		}
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
		for _, tc := range []struct {
			cli  *clientv3.Client
			opts WatcherOptions
			want error
		}{
			{nil, WatcherOptions{}, ErrNilClient},
			{cli, WatcherOptions{Prefix: "/coord/hosts"}, ErrInvalidKey},
			{cli, WatcherOptions{Buffer: -1}, ErrInvalidBuffer},
			{cli, WatcherOptions{PageSize: -1}, ErrInvalidBuffer},
		} {
			w, err := NewHostWatcher(ctx, tc.cli, tc.opts)
			if !errors.Is(err, tc.want) || w != nil {
				t.Errorf("NewHostWatcher(%+v) = %v, %v; want nil, %v", tc.opts, w, err, tc.want)
			}
		}
	})

	t.Run("watches HostsPrefix by default", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		wtPut(t, cli, HostsPrefix, meta("a"), 0)
		w := wtWatch(t, ctx, cli, WatcherOptions{})
		if ev := expect(t, w, HostUp, "a"); !ev.Synthetic {
			t.Fatalf("snapshot Up %+v", ev)
		}
		if cap(w.Events()) != 0 {
			t.Fatalf("Events capacity %d, want unbuffered", cap(w.Events()))
		}
	})
}

// wtWatch starts a watcher closed when the test ends.
func wtWatch(t *testing.T, ctx context.Context, cli *clientv3.Client, opts WatcherOptions) *HostWatcher {
	t.Helper()
	w, err := NewHostWatcher(ctx, cli, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

// wtSynced starts a watcher on an empty prefix and waits for its Synced.
func wtSynced(t *testing.T, ctx context.Context, cli *clientv3.Client, opts WatcherOptions) *HostWatcher {
	t.Helper()
	w := wtWatch(t, ctx, cli, opts)
	if !closedWithin(w.Synced()) {
		t.Fatal("Synced not closed")
	}
	return w
}

// wtSyncedEtcd starts an etcd of the test's own and a watcher, synced, on
// the test's empty prefix; the test's ctx runs the watcher.
func wtSyncedEtcd(t *testing.T) (srv *coordtest.Server, cli *clientv3.Client, ctx context.Context, prefix string, w *HostWatcher) {
	t.Helper()
	srv, cli = newEtcd(t)
	ctx, prefix = testCtx(t), prefixFor(t)
	return srv, cli, ctx, prefix, wtSynced(t, ctx, cli, WatcherOptions{Prefix: prefix})
}

// untilSynced reads the events of w as a consumer that selects on Events
// and Synced does, until it sees Synced, and returns the events it read
// before; it fails the test after patience.
func untilSynced(t *testing.T, w *HostWatcher) []HostEvent {
	t.Helper()
	deadline := time.After(patience())
	var evs []HostEvent
	for {
		select {
		case ev, ok := <-w.Events():
			if !ok {
				t.Fatalf("events closed before Synced: %v", w.Err())
			}
			evs = append(evs, ev)
		case <-w.Synced():
			return evs
		case <-deadline:
			t.Fatalf("Synced not closed after %d events", len(evs))
		}
	}
}

// wtFallbackMsg is the record of a watcher whose paged listings were
// compacted away again and again.
const wtFallbackMsg = "coord: paged listing compacted away again and again, listing in one read"

// wtCompactEvery compacts etcd's history every d, each time after writing
// key so that there is history to compact, until the returned function is
// called (or the test ends); that function waits for the compactions to
// stop.
func wtCompactEvery(t *testing.T, cli *clientv3.Client, key string, d time.Duration) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(d)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			put, err := cli.Put(ctx, key, "x")
			if err == nil {
				_, err = cli.Compact(ctx, put.Header.Revision)
			}
			if err != nil && ctx.Err() == nil {
				t.Errorf("compacting: %v", err)
				return
			}
		}
	}()
	stop = func() { cancel(); <-done }
	t.Cleanup(stop)
	return stop
}

// wtEnded checks that Events closes, with no event left, and Wait returns.
func wtEnded(t *testing.T, w *HostWatcher) {
	t.Helper()
	select {
	case ev, ok := <-w.Events():
		if ok {
			t.Fatalf("event %+v, want Events closed", ev)
		}
	case <-time.After(patience()):
		t.Fatal("Events not closed")
	}
	waited := make(chan struct{})
	go func() { w.Wait(); close(waited) }()
	if !closedWithin(waited) {
		t.Fatal("Wait did not return")
	}
}

// wtNoErr fails the test if w has failed.
func wtNoErr(t *testing.T, w *HostWatcher) {
	t.Helper()
	if err := w.Err(); err != nil {
		t.Fatalf("Err %v", err)
	}
}

// wtCheck checks an event's metadata, revision (unless 0) and origin.
func wtCheck(t *testing.T, ev HostEvent, m HostMetadata, rev int64, synthetic bool) {
	t.Helper()
	if !reflect.DeepEqual(ev.Metadata, m) || (rev != 0 && ev.Revision != rev) || ev.Synthetic != synthetic {
		t.Fatalf("event %+v, want metadata %+v, revision %d, synthetic %v", ev, m, rev, synthetic)
	}
}

// wtGrant grants a lease that outlives the test.
func wtGrant(t *testing.T, cli *clientv3.Client) clientv3.LeaseID {
	t.Helper()
	g, err := cli.Grant(testCtx(t), 300)
	if err != nil {
		t.Fatal(err)
	}
	return g.ID
}

// wtPut writes m at its key under lease (none if 0) and returns the revision.
func wtPut(t *testing.T, cli *clientv3.Client, prefix string, m HostMetadata, lease clientv3.LeaseID) int64 {
	t.Helper()
	var opts []clientv3.OpOption
	if lease != 0 {
		opts = append(opts, clientv3.WithLease(lease))
	}
	resp, err := cli.Put(testCtx(t), prefix+m.HostUUID, wtJSON(m), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

func wtJSON(m HostMetadata) string {
	b, _ := json.Marshal(m)
	return string(b)
}

func wtSorted(hosts map[string]HostMetadata) []HostMetadata {
	out := make([]HostMetadata, 0, len(hosts))
	for _, id := range slices.Sorted(maps.Keys(hosts)) {
		out = append(out, hosts[id])
	}
	return out
}

func wtIDs(hosts []HostMetadata) []string {
	var ids []string
	for _, h := range hosts {
		ids = append(ids, h.HostUUID)
	}
	return ids
}

// wtPutAll writes the metadata of hosts ids under lease.
func wtPutAll(t *testing.T, cli *clientv3.Client, prefix string, lease clientv3.LeaseID, ids ...string) {
	t.Helper()
	for _, id := range ids {
		wtPut(t, cli, prefix, meta(id), lease)
	}
}

// wtPutHosts writes n hosts, h0000 on, under lease, a hundred a Txn.
func wtPutHosts(t *testing.T, cli *clientv3.Client, prefix string, lease clientv3.LeaseID, n int) {
	t.Helper()
	wtPutRange(t, cli, prefix, lease, 0, n)
}

// wtPutRange writes hosts h<from> to h<to-1> (four digits) under lease, a
// hundred a Txn.
func wtPutRange(t *testing.T, cli *clientv3.Client, prefix string, lease clientv3.LeaseID, from, to int) {
	t.Helper()
	for i := from; i < to; i += 100 {
		var ops []clientv3.Op
		for j := i; j < min(i+100, to); j++ {
			id := fmt.Sprintf("h%04d", j)
			ops = append(ops, clientv3.OpPut(prefix+id, wtJSON(meta(id)), clientv3.WithLease(lease)))
		}
		if _, err := cli.Txn(testCtx(t)).Then(ops...).Commit(); err != nil {
			t.Fatal(err)
		}
	}
}

// wtReplica is a consumer's copy of the host set, built from events. It
// fails the test on an event that does not fit the copy.
type wtReplica struct {
	t     *testing.T
	hosts map[string]HostMetadata
	ups   map[string]int
}

// untilMatches applies the events of w until the replica holds what etcd
// holds under prefix, failing the test after patience.
func (r *wtReplica) untilMatches(w *HostWatcher, cli *clientv3.Client, prefix string) {
	r.t.Helper()
	deadline := time.Now().Add(patience())
	for !reflect.DeepEqual(r.hosts, truth(r.t, cli, prefix)) {
		if time.Now().After(deadline) {
			r.matches(cli, prefix)
		}
		r.apply(next(r.t, w))
	}
}

// wtAheadHeard makes etcd's revision go 20 past the watcher's prefix
// (which its watch hears nothing of) and waits until the probe of its
// silence has heard it.
func wtAheadHeard(t *testing.T, srv *coordtest.Server, cli *clientv3.Client, w *HostWatcher) {
	t.Helper()
	for range 20 {
		wtPut(t, cli, "/elsewhere/", meta("x"), 0)
	}
	rev := srv.Revision(testCtx(t))
	eventually(t, "the watcher hearing etcd's revision", func() bool {
		w.mark.mu.Lock()
		defer w.mark.mu.Unlock()
		return w.mark.rev >= rev
	})
}

// wtReplacedSeen records a watcher's SignalEtcdReplaced, with what its
// Healthy said as each came.
type wtReplacedSeen struct {
	mu      sync.Mutex
	signals []Signal
	health  []error
}

// wtReplacedWatcher starts a watcher on the test's prefix, UnhealthyAfter
// unhealthy, that records its SignalEtcdReplaced.
func wtReplacedWatcher(t *testing.T, cli *clientv3.Client, unhealthy time.Duration) (*HostWatcher, *wtReplacedSeen) {
	t.Helper()
	seen := &wtReplacedSeen{}
	var wp atomic.Pointer[HostWatcher]
	w := wtSynced(t, testCtx(t), cli, WatcherOptions{Prefix: prefixFor(t), UnhealthyAfter: unhealthy, OnSignal: func(s Signal) {
		if s.Kind == SignalEtcdReplaced {
			seen.mu.Lock()
			defer seen.mu.Unlock()
			seen.signals = append(seen.signals, s)
			seen.health = append(seen.health, wp.Load().Healthy())
		}
	}})
	wp.Store(w)
	return w, seen
}

// check fails the test unless w, the watcher of prefix, said once that
// etcd was replaced, unhealthy then, and is healthy now, with no error.
func (seen *wtReplacedSeen) check(t *testing.T, w *HostWatcher, prefix string) {
	t.Helper()
	seen.mu.Lock()
	defer seen.mu.Unlock()
	if len(seen.signals) != 1 {
		t.Fatalf("%d signals that etcd was replaced, want 1: %v", len(seen.signals), seen.signals)
	}
	sig, health := seen.signals[0], seen.health[0]
	t.Logf("signal: %v; Healthy then: %v", sig.Err, health)
	if sig.Key != prefix || sig.Err == nil || !strings.Contains(sig.Err.Error(), "etcd replaced") {
		t.Fatalf("signal %+v, want Key %q and Err saying etcd was replaced", sig, prefix)
	}
	if health == nil || !strings.Contains(health.Error(), "etcd replaced") {
		t.Fatalf("Healthy when etcd was found replaced: %v, want an error saying so", health)
	}
	eventually(t, "healthy again", func() bool { return w.Healthy() == nil })
	wtNoErr(t, w)
}

func newWtReplica(t *testing.T) *wtReplica {
	return &wtReplica{t: t, hosts: map[string]HostMetadata{}, ups: map[string]int{}}
}

// applyNext applies the next n events of w.
func (r *wtReplica) applyNext(w *HostWatcher, n int) {
	r.t.Helper()
	for range n {
		r.apply(next(r.t, w))
	}
}

// matches fails the test unless the replica holds the hosts etcd holds
// under prefix.
func (r *wtReplica) matches(cli *clientv3.Client, prefix string) {
	r.t.Helper()
	if truth := truth(r.t, cli, prefix); !reflect.DeepEqual(r.hosts, truth) {
		r.t.Fatalf("replica %v, etcd %v", slices.Sorted(maps.Keys(r.hosts)), slices.Sorted(maps.Keys(truth)))
	}
}

func (r *wtReplica) apply(ev HostEvent) {
	r.t.Helper()
	old, had := r.hosts[ev.HostUUID]
	switch ev.Kind {
	case HostUp:
		if had {
			r.t.Fatalf("Up of host %s already up", ev.HostUUID)
		}
		r.ups[ev.HostUUID]++
		r.hosts[ev.HostUUID] = ev.Metadata
	case HostUpdated:
		if !had {
			r.t.Fatalf("Updated of unknown host %s", ev.HostUUID)
		}
		r.hosts[ev.HostUUID] = ev.Metadata
	case HostDown:
		if !had || !reflect.DeepEqual(old, ev.Metadata) {
			r.t.Fatalf("Down of host %s carries %+v, want the last metadata %+v (known: %v)", ev.HostUUID, ev.Metadata, old, had)
		}
		delete(r.hosts, ev.HostUUID)
	default:
		r.t.Fatalf("event of kind %v", ev.Kind)
	}
}

// wtRange is one Range a client sent and the answer it got.
type wtRange struct {
	limit, rev int64 // asked for: at most limit keys, at revision rev
	kvs        int   // the keys it got
	more       bool  // whether more keys are left
}

// wtRanges records the Ranges a client sends and answers it gets.
type wtRanges struct {
	mu  sync.Mutex
	log []wtRange
	n   int
}

func (r *wtRanges) list() []wtRange {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.log)
}

// wtRangeClient returns a client made from cfg, closed at the end of the
// test, that records each answered Range. Before sending its nth Range
// (from 1) it calls before(n), if given: a fault injected at that moment.
func wtRangeClient(t *testing.T, cfg clientv3.Config, before func(n int)) (*clientv3.Client, *wtRanges) {
	t.Helper()
	r := &wtRanges{}
	cfg.DialOptions = append(slices.Clone(cfg.DialOptions),
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any,
			cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			rr, ok := req.(*pb.RangeRequest)
			if !ok {
				return invoker(ctx, method, req, reply, cc, opts...)
			}
			r.mu.Lock()
			r.n++
			n := r.n
			r.mu.Unlock()
			if before != nil {
				before(n)
			}
			err := invoker(ctx, method, req, reply, cc, opts...)
			if err == nil {
				resp := reply.(*pb.RangeResponse)
				r.mu.Lock()
				r.log = append(r.log, wtRange{limit: rr.Limit, rev: rr.Revision, kvs: len(resp.Kvs), more: resp.More})
				r.mu.Unlock()
			}
			return err
		}))
	c, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, r
}
