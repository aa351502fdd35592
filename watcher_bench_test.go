package coord

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/coordtest"
)

// The hot paths of a HostWatcher, without etcd: decoding a host's value,
// applying a watch event to the view, and diffing a snapshot against it.
// Each has a "plain" baseline: what a user's own Get + Watch code does for
// the same input (json.Unmarshal into a map). Run with
//
//	go test -bench 'DecodeHost|WatcherApply|Resync|Hosts' -run '^$' -benchmem
//
// Then, against an embedded etcd and by hand (they take from seconds to a
// minute): BenchmarkWatcherSync (time to Synced and heap per host, next to
// the plain code) and BenchmarkWatcherStartStorm (200 watchers starting at
// once on a three-member cluster).

const benchPrefix = "/coord/hosts/"

// benchMeta is realistic metadata for host i: a UUID, an FQDN, two labels.
func benchMeta(i int) HostMetadata {
	return HostMetadata{
		HostUUID:   fmt.Sprintf("3f1c9a7e-%04x-4000-8000-%012x", i>>16, i),
		Hostname:   fmt.Sprintf("node-%05d.dc1.example.net", i),
		Hypervisor: "kvm",
		Version:    "1.4.2",
		StartedAt:  1767225600_000000000 + int64(i),
		Labels:     map[string]string{"zone": "z" + strconv.Itoa(i%3), "rack": fmt.Sprintf("r%02d", i%40)},
	}
}

// benchKV is host i's key-value as etcd returns it, under lease.
func benchKV(i int, lease, rev int64) *mvccpb.KeyValue {
	m := benchMeta(i)
	v, _ := json.Marshal(m)
	return &mvccpb.KeyValue{
		Key: []byte(benchPrefix + m.HostUUID), Value: v, Lease: lease,
		CreateRevision: rev, ModRevision: rev, Version: 1,
	}
}

// rewritten is kv written again, under lease at revisions create and mod.
func rewritten(kv *mvccpb.KeyValue, lease, create, mod int64) *mvccpb.KeyValue {
	return &mvccpb.KeyValue{Key: kv.Key, Value: kv.Value, Lease: lease, CreateRevision: create, ModRevision: mod, Version: 1}
}

func benchKVs(n int, lease, rev int64) []*mvccpb.KeyValue {
	kvs := make([]*mvccpb.KeyValue, n)
	for i := range kvs {
		kvs[i] = benchKV(i, lease, rev)
	}
	return kvs
}

// newBenchWatcher is a HostWatcher with no goroutine and no client: its
// view and its decoding only.
func newBenchWatcher() *HostWatcher {
	return &HostWatcher{prefix: benchPrefix, log: discard, hosts: map[string]*version{}}
}

// benchViewOf returns a bench watcher whose view holds kvs at revision 10,
// and starts reporting allocations.
func benchViewOf(b *testing.B, kvs []*mvccpb.KeyValue) *HostWatcher {
	w := newBenchWatcher()
	benchResync(w, kvs, 10)
	b.ReportAllocs()
	return w
}

// benchResync lists kvs, one page, at rev into w's view, and returns the
// events.
func benchResync(w *HostWatcher, kvs []*mvccpb.KeyValue, rev int64) []pending {
	s := &snapshot{rev: rev}
	w.read(s, kvs)
	return w.resync(nil, s)
}

// plainDecode is the baseline's decoding of one value.
func plainDecode(hosts map[string]HostMetadata, kv *mvccpb.KeyValue) {
	var m HostMetadata
	if json.Unmarshal(kv.Value, &m) == nil {
		hosts[m.HostUUID] = m
	}
}

// BenchmarkDecodeHost decodes one host value: what every listed host and
// every put event costs.
func BenchmarkDecodeHost(b *testing.B) {
	kv := benchKV(42, 7, 100)
	b.Run("coord", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := decodeHost(benchPrefix, kv.Key, kv.Value); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("plain", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var m HostMetadata
			if err := json.Unmarshal(kv.Value, &m); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkWatcherApply applies watch events to a view of 10,000 hosts: a
// host flapping (its key deleted, then put under a new lease: Down, Up),
// and a metadata update (Updated). ns/op is per event.
func BenchmarkWatcherApply(b *testing.B) {
	const n = 10_000
	kvs := benchKVs(n, 1, 10)
	b.Run("coord/flap", func(b *testing.B) {
		w := benchViewOf(b, kvs)
		i := 0
		for b.Loop() {
			kv := kvs[i%n]
			rev := int64(11 + i)
			if i%2 == 0 {
				w.apply(nil, &clientv3.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: kv.Key, ModRevision: rev}})
			} else {
				w.apply(nil, &clientv3.Event{Type: mvccpb.PUT, Kv: rewritten(kv, rev, rev, rev)})
			}
			if i%2 == 1 {
				i++ // next host
			}
			i++
		}
	})
	b.Run("coord/update", func(b *testing.B) {
		w := benchViewOf(b, kvs)
		i := 0
		for b.Loop() {
			kv := kvs[i%n]
			up := rewritten(kv, kv.Lease, kv.CreateRevision, int64(11+i))
			if evs := w.apply(nil, &clientv3.Event{Type: mvccpb.PUT, Kv: up}); len(evs) != 1 || evs[0].kind != HostUpdated {
				b.Fatalf("events %v, want one Updated", evs)
			}
			i++
		}
	})
	b.Run("plain/update", func(b *testing.B) {
		hosts := map[string]HostMetadata{}
		for _, kv := range kvs {
			plainDecode(hosts, kv)
		}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			plainDecode(hosts, kvs[i%n])
			i++
		}
	})
}

// BenchmarkResync diffs a snapshot of n hosts against the view: "initial"
// is what NewHostWatcher does (empty view, n synthetic Ups), "unchanged" a
// resync after a broken watch that missed nothing, "changed-1pct" one where
// 1% of the hosts re-registered and 1% went away. "plain" is a user's Get
// loop over the same snapshot. ns/host is per listed host.
func BenchmarkResync(b *testing.B) {
	for _, n := range []int{1_000, 10_000} {
		kvs := benchKVs(n, 1, 10)
		perHost := func(b *testing.B) {
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/host")
		}
		b.Run(fmt.Sprintf("coord/initial/%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				w := newBenchWatcher()
				if evs := benchResync(w, kvs, 10); len(evs) != n {
					b.Fatalf("%d events, want %d", len(evs), n)
				}
			}
			perHost(b)
		})
		b.Run(fmt.Sprintf("coord/unchanged/%d", n), func(b *testing.B) {
			w := benchViewOf(b, kvs)
			for b.Loop() {
				if evs := benchResync(w, kvs, 10); len(evs) != 0 {
					b.Fatalf("%d events, want none", len(evs))
				}
			}
			perHost(b)
		})
		b.Run(fmt.Sprintf("coord/changed-1pct/%d", n), func(b *testing.B) {
			// Two snapshots: the second has 1% of hosts under a new lease
			// and 1% gone; resync alternates between them.
			next := make([]*mvccpb.KeyValue, 0, n)
			for i, kv := range kvs {
				switch i % 100 {
				case 0:
					next = append(next, rewritten(kv, 2, 20, 20))
				case 1:
				default:
					next = append(next, kv)
				}
			}
			snaps := [2][]*mvccpb.KeyValue{kvs, next}
			w := benchViewOf(b, kvs)
			i := 1
			for b.Loop() {
				if evs := benchResync(w, snaps[i%2], int64(20+i)); len(evs) == 0 {
					b.Fatal("no events")
				}
				i++
			}
			perHost(b)
		})
		b.Run(fmt.Sprintf("plain/initial/%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				hosts := make(map[string]HostMetadata, len(kvs))
				for _, kv := range kvs {
					plainDecode(hosts, kv)
				}
			}
			perHost(b)
		})
	}
}

// BenchmarkHosts copies the sorted view of 10,000 hosts.
func BenchmarkHosts(b *testing.B) {
	w := benchViewOf(b, benchKVs(10_000, 1, 10))
	for b.Loop() {
		w.Hosts()
	}
}

// BenchmarkWatcherSync starts a HostWatcher on n hosts held by an embedded
// etcd, next to the plain code a user would write: Get, json.Unmarshal of
// every host into a presized map[string]HostMetadata, Watch from the next
// revision. The sides alternate within each iteration, so that they share
// the machine's noise. Reported, medians over the iterations:
//   - coord-ms, plain-ms, time-ratio: coord from NewHostWatcher to Synced,
//     with a consumer reading every synthetic Up; plain from the Get to
//     the Watch call.
//   - coord-B/host, plain-B/host, heap-ratio: HeapAlloc after GC, once
//     synced (and every Up read) minus before the start, per host. The
//     consumer keeps nothing: the watcher's view is the replica.
//
// Run by hand, e.g.
//
//	go test -run '^$' -bench 'WatcherSync/hosts=20000' -benchtime 5x
func BenchmarkWatcherSync(b *testing.B) {
	for _, n := range []int{20_000, 100_000} {
		b.Run(fmt.Sprintf("hosts=%d", n), func(b *testing.B) {
			srv := coordtest.NewServer(b)
			cli := srv.Client()
			ctx := context.Background()
			benchPutHosts(b, cli, benchPrefix, n)
			var ct, pt, ch, ph []float64
			for b.Loop() {
				d, heap := benchSyncCoord(b, ctx, cli, n, WatcherOptions{Prefix: benchPrefix})
				ct, ch = append(ct, d.Seconds()*1e3), append(ch, heap)
				d, heap = benchSyncPlain(b, ctx, cli, n)
				pt, ph = append(pt, d.Seconds()*1e3), append(ph, heap)
			}
			b.ReportMetric(benchMedian(ct), "coord-ms")
			b.ReportMetric(benchMedian(pt), "plain-ms")
			b.ReportMetric(benchMedian(ct)/benchMedian(pt), "time-ratio")
			b.ReportMetric(benchMedian(ch), "coord-B/host")
			b.ReportMetric(benchMedian(ph), "plain-B/host")
			b.ReportMetric(benchMedian(ch)/benchMedian(ph), "heap-ratio")
			b.Logf("coord ms %.0f, plain ms %.0f, coord B/host %.0f, plain B/host %.0f", ct, pt, ch, ph)
		})
	}
}

// benchPutHosts writes hosts 0..n-1 under prefix, 100 puts per Txn, under
// one lease.
func benchPutHosts(b *testing.B, cli *clientv3.Client, prefix string, n int) {
	ctx := context.Background()
	g, err := cli.Grant(ctx, 3600)
	if err != nil {
		b.Fatal(err)
	}
	const batch, writers = 100, 4
	var wg sync.WaitGroup
	errs := make([]error, writers)
	for w := range writers {
		wg.Go(func() {
			for lo := w * batch; lo < n && errs[w] == nil; lo += writers * batch {
				ops := make([]clientv3.Op, 0, batch)
				for i := lo; i < min(lo+batch, n); i++ {
					kv := benchKV(i, 0, 0)
					ops = append(ops, clientv3.OpPut(string(kv.Key), string(kv.Value), clientv3.WithLease(g.ID)))
				}
				_, errs[w] = cli.Txn(ctx).Then(ops...).Commit()
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
}

// benchHeap returns the live heap after a full collection.
func benchHeap() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

func benchMedian(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// benchSyncCoord starts a watcher on the n hosts under opts.Prefix, reads
// every synthetic Up, and returns the time to Synced and the heap per host
// once synced.
func benchSyncCoord(b *testing.B, ctx context.Context, cli *clientv3.Client, n int, opts WatcherOptions) (time.Duration, float64) {
	h0 := benchHeap()
	start := time.Now()
	w, err := NewHostWatcher(ctx, cli, opts)
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close()
	read := make(chan int)
	go func() {
		seen := 0
		for range w.Events() {
			if seen++; seen == n {
				read <- seen
			}
		}
	}()
	<-w.Synced()
	d := time.Since(start)
	<-read
	return d, float64(benchHeap()-h0) / float64(n)
}

// benchSyncPlain lists the n hosts under benchPrefix as a user would
// without coord, and returns the time until its watch is started and the
// heap per host then.
func benchSyncPlain(b *testing.B, ctx context.Context, cli *clientv3.Client, n int) (time.Duration, float64) {
	h0 := benchHeap()
	start := time.Now()
	resp, err := cli.Get(ctx, benchPrefix, clientv3.WithPrefix())
	if err != nil {
		b.Fatal(err)
	}
	hosts := make(map[string]HostMetadata, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		plainDecode(hosts, kv)
	}
	wctx, cancel := context.WithCancel(ctx)
	wch := cli.Watch(wctx, benchPrefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	d := time.Since(start)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for wr := range wch {
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete {
					delete(hosts, strings.TrimPrefix(string(ev.Kv.Key), benchPrefix))
				} else {
					plainDecode(hosts, ev.Kv)
				}
			}
		}
	}()
	defer func() { cancel(); <-done }()
	if len(hosts) != n {
		b.Fatalf("listed %d hosts, want %d", len(hosts), n)
	}
	return d, float64(benchHeap()-h0) / float64(n)
}

// BenchmarkWatcherStartStorm is a fleet restarting at once: a three-member
// embedded etcd cluster holds 10,000 hosts, then 200 watchers, each on its
// own client, start together. Each iteration runs the storm twice, in
// alternating order: with the default PageSize ("paged") and with a
// PageSize over the number of hosts ("unpaged": one Range each, as a
// single Get would). Reported, medians over the iterations, per side:
//   - last-ms: from the first NewHostWatcher to the last Synced;
//   - median-ms: to the median watcher's Synced;
//   - peak-MB: the process's peak resident memory during the storm, over
//     what it was before (Linux only). It covers everything in this
//     process: the three etcd members, the 200 clients and their
//     watchers, whose views alone keep some 1.2 GB once synced;
//   - views-MB: that live heap once every watcher is synced, so that
//     peak-MB minus views-MB is what the storm needed on top: the
//     responses etcd built and sent, the clients' buffers, garbage.
//
// Run by hand; it takes about a minute on two cores:
//
//	go test -run '^$' -bench WatcherStartStorm -benchtime 3x
func BenchmarkWatcherStartStorm(b *testing.B) {
	const hosts, watchers = 10_000, 200
	c := coordtest.NewCluster(b, 3)
	benchPutHosts(b, c.Client(), benchPrefix, hosts)
	sides := []struct {
		name string
		page int
	}{{"paged", 0}, {"unpaged", hosts + 1}}
	res := map[string][4][]float64{}
	i := 0
	for b.Loop() {
		for j := range sides {
			side := sides[(i+j)%len(sides)] // alternate who goes first
			last, median, peak, views := benchStorm(b, c, hosts, watchers, side.page)
			r := res[side.name]
			for k, x := range []float64{last, median, peak, views} {
				r[k] = append(r[k], x)
			}
			res[side.name] = r
		}
		i++
	}
	for _, side := range sides {
		r := res[side.name]
		for k, unit := range []string{"last-ms", "median-ms", "peak-MB", "views-MB"} {
			b.ReportMetric(benchMedian(r[k]), side.name+"-"+unit)
		}
		b.Logf("%s: last ms %.0f, median ms %.0f, peak MB %.0f, views MB %.0f", side.name, r[0], r[1], r[2], r[3])
	}
}

// benchStorm starts watchers on their own clients at once, each with a
// consumer reading every event, and waits until all are synced. It returns
// the time to the last and the median Synced (ms), the peak resident
// memory over before (MB; -1 where unknown) and the live heap then (MB).
func benchStorm(b *testing.B, c *coordtest.Cluster, hosts, watchers, page int) (last, median, peak, views float64) {
	ctx := context.Background()
	clis := make([]*clientv3.Client, watchers)
	for i := range clis {
		clis[i] = c.NewClient(b)
		if _, err := clis[i].Get(ctx, "x"); err != nil { // connected
			b.Fatal(err)
		}
	}
	heap0 := benchHeap()
	debug.FreeOSMemory()
	rss0 := benchResetPeakRSS()
	start := time.Now()
	synced := make([]float64, watchers)
	var wg sync.WaitGroup
	ws := make([]*HostWatcher, watchers)
	for i := range ws {
		w, err := NewHostWatcher(ctx, clis[i], WatcherOptions{Prefix: benchPrefix, PageSize: page})
		if err != nil {
			b.Fatal(err)
		}
		ws[i] = w
		wg.Go(func() {
			n := 0
			for range w.Events() {
				if n++; n == hosts {
					synced[i] = time.Since(start).Seconds() * 1e3
				}
			}
		})
	}
	deadline := time.After(2 * time.Minute)
	for i, w := range ws {
		select {
		case <-w.Synced():
		case <-deadline:
			b.Fatalf("watcher %d not synced after 2 minutes (Err %v)", i, w.Err())
		}
	}
	peak = -1
	if hwm := benchPeakRSS(); rss0 >= 0 && hwm >= 0 {
		peak = float64(hwm-rss0) / 1e6
	}
	views = float64(benchHeap()-heap0) / 1e6
	for i, w := range ws {
		w.Close()
		clis[i].Close()
	}
	wg.Wait()
	slices.Sort(synced)
	return synced[len(synced)-1], synced[len(synced)/2], peak, views
}

// benchResetPeakRSS resets the kernel's record of the process's peak
// resident memory and returns the resident memory now, in bytes; -1 where
// the kernel does not offer it.
func benchResetPeakRSS() int64 {
	if os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) != nil {
		return -1
	}
	return benchStatus("VmRSS:")
}

// benchPeakRSS returns the process's peak resident memory since the last
// reset, in bytes; -1 if unknown.
func benchPeakRSS() int64 { return benchStatus("VmHWM:") }

// benchStatus reads a "<field> <n> kB" line of the process's status.
func benchStatus(field string) int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return -1
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, field); ok {
			var kb int64
			if _, err := fmt.Sscanf(rest, "%d kB", &kb); err == nil {
				return kb << 10
			}
		}
	}
	return -1
}
