package coord

import (
	"encoding/json"
	"fmt"
	"strconv"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The hot paths of a HostWatcher, without etcd: decoding a host's value,
// applying a watch event to the view, and diffing a snapshot against it.
// Each has a "plain" baseline: what a user's own Get + Watch code does for
// the same input (json.Unmarshal into a map). Run with
//
//	go test -bench . -run '^$' -benchmem

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
	return &HostWatcher{prefix: benchPrefix, log: discard, hosts: map[string]watched{}}
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
		w := newBenchWatcher()
		w.resync(kvs, 10)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			kv := kvs[i%n]
			rev := int64(11 + i)
			if i%2 == 0 {
				w.apply(&clientv3.Event{Type: mvccpb.DELETE, Kv: &mvccpb.KeyValue{Key: kv.Key, ModRevision: rev}})
			} else {
				w.apply(&clientv3.Event{Type: mvccpb.PUT, Kv: rewritten(kv, rev, rev, rev)})
			}
			if i%2 == 1 {
				i++ // next host
			}
			i++
		}
	})
	b.Run("coord/update", func(b *testing.B) {
		w := newBenchWatcher()
		w.resync(kvs, 10)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			kv := kvs[i%n]
			up := rewritten(kv, kv.Lease, kv.CreateRevision, int64(11+i))
			if evs := w.apply(&clientv3.Event{Type: mvccpb.PUT, Kv: up}); len(evs) != 1 || evs[0].ev.Kind != HostUpdated {
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
				if evs := w.resync(kvs, 10); len(evs) != n {
					b.Fatalf("%d events, want %d", len(evs), n)
				}
			}
			perHost(b)
		})
		b.Run(fmt.Sprintf("coord/unchanged/%d", n), func(b *testing.B) {
			w := newBenchWatcher()
			w.resync(kvs, 10)
			b.ReportAllocs()
			for b.Loop() {
				if evs := w.resync(kvs, 10); len(evs) != 0 {
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
			w := newBenchWatcher()
			w.resync(kvs, 10)
			b.ReportAllocs()
			i := 1
			for b.Loop() {
				if evs := w.resync(snaps[i%2], int64(20+i)); len(evs) == 0 {
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
	w := newBenchWatcher()
	w.resync(benchKVs(10_000, 1, 10), 10)
	b.ReportAllocs()
	for b.Loop() {
		w.Hosts()
	}
}
