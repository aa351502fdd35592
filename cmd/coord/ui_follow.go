package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/go-coord/coord"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// How coord ui follows etcd: the hosts with a HostWatcher; the
// elections, the shards and the semaphores each with a watch on their
// prefix that lists the prefix again on every change; the leases' time
// left, which no watch reports, read every uiTTLEvery.
const (
	uiTTLEvery = time.Second
	// uiFirstRead bounds coord ui's first read of the leases' time left.
	uiFirstRead = 10 * time.Second
	// uiProbeEvery is how often coord ui asks whether etcd answers.
	uiProbeEvery = 500 * time.Millisecond
	// A listing or watch that fails is tried again after uiRetryMin,
	// doubling up to uiRetryMax while it fails.
	uiRetryMin = 100 * time.Millisecond
	uiRetryMax = 2 * time.Second
)

// followHosts applies the watcher's events to st until they end.
func followHosts(ctx context.Context, w *coord.HostWatcher, st *uiState) {
	for ev := range w.Events() {
		st.noteHost(ev, time.Now())
	}
	if ctx.Err() == nil {
		st.problem("hosts", fmt.Errorf("host watcher ended: %v", w.Err()))
	}
}

// followTTLs reads the time left on the hosts' leases every uiTTLEvery
// until ctx ends.
func followTTLs(ctx context.Context, cli *clientv3.Client, prefix string, st *uiState) {
	t := time.NewTicker(uiTTLEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		readTTLs(ctx, cli, prefix, st, uiTTLEvery)
	}
}

// probeEtcd asks etcd every uiProbeEvery, until ctx ends, for a
// linearizable count of the hosts (a member without quorum does not
// answer it), and records whether it answered within two of them (a slow
// machine's answer is not an outage).
//
// Its answers also say which etcd answers: another cluster, or a revision
// below one it saw (an etcd rebuilt, or restored from a snapshot), has
// every part listed again (see uiState.replaced): a watch resumed on such
// an etcd from our revision would wait in silence. It compares with
// first, the highest header of the first listings: an etcd replaced
// before the first probe is answered is found too.
func probeEtcd(ctx context.Context, cli *clientv3.Client, prefix string, st *uiState, first *etcdserverpb.ResponseHeader) {
	t := time.NewTicker(uiProbeEvery)
	defer t.Stop()
	cluster, rev := first.ClusterId, first.Revision
	for {
		pctx, cancel := context.WithTimeout(ctx, 2*uiProbeEvery)
		resp, err := cli.Get(pctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			h := resp.Header
			if h.ClusterId != cluster || h.Revision < rev {
				st.replaced(fmt.Sprintf("cluster %x at revision %d, after cluster %x at revision %d", h.ClusterId, h.Revision, cluster, rev), time.Now())
				rev = 0
			}
			cluster, rev = h.ClusterId, max(rev, h.Revision)
		}
		st.answered(err == nil, time.Now())
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// readTTLs reads the time left on the hosts' leases, within bound.
func readTTLs(ctx context.Context, cli *clientv3.Client, prefix string, st *uiState, bound time.Duration) {
	rctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	sent := time.Now()
	hosts, err := listHosts(rctx, cli, prefix, io.Discard)
	if ctx.Err() != nil {
		return
	}
	st.problem("leases", err)
	if err == nil {
		st.noteTTLs(hosts, sent)
	}
}

// prefixFollower keeps one part of the state (the elections, the shards
// or the semaphores) in step with the keys under prefix: it lists them,
// watches from the next revision, and lists them again at each change;
// the listing is what the state shows, so an event needs no decoding, and
// a compaction, a broken watch or an etcd restart is one more listing.
type prefixFollower struct {
	cli    *clientv3.Client
	st     *uiState
	part   string // "elections", "shards" or "semaphores"
	prefix string
	apply  func(kvs []*mvccpb.KeyValue) // under st's lock
}

// list reads the keys under the prefix, by create revision, applies them
// and returns the header of the answer (the revision read).
func (f *prefixFollower) list(ctx context.Context) (*etcdserverpb.ResponseHeader, error) {
	resp, err := f.cli.Get(ctx, f.prefix, clientv3.WithPrefix(),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	if err != nil {
		return nil, fmt.Errorf("list %s under %s: %w", f.part, f.prefix, err)
	}
	f.st.update(func() { f.apply(resp.Kvs) })
	f.st.problem(f.part, nil)
	return resp.Header, nil
}

// run follows the prefix from revision rev, listed already, until ctx
// ends.
func (f *prefixFollower) run(ctx context.Context, rev int64) {
	delay := uiRetryMin
	for {
		if next, _ := f.watch(ctx, rev); next > rev {
			rev, delay = next, uiRetryMin
		}
		// The watch broke (why is no matter: the listing says whether
		// etcd can be read); list again, then watch on.
		for {
			if !wait(ctx, delay) {
				return
			}
			delay = min(2*delay, uiRetryMax)
			h, err := f.list(ctx)
			if err == nil {
				rev = h.Revision
				break
			}
			if ctx.Err() != nil {
				return
			}
			f.st.problem(f.part, err)
		}
	}
}

// watch watches the prefix from rev+1 and lists it again at each change,
// until the watch breaks (a compaction, no leader, ctx), and returns the
// last revision listed and why it stopped.
func (f *prefixFollower) watch(ctx context.Context, rev int64) (int64, error) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	// An etcd found replaced ends the watch: the listing is of the new one.
	relist := f.st.relisting()
	go func() {
		select {
		case <-relist:
			cancel()
		case <-wctx.Done():
		}
	}()
	for resp := range f.cli.Watch(wctx, f.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1)) {
		if err := resp.Err(); err != nil {
			return rev, fmt.Errorf("watch %s under %s: %w", f.part, f.prefix, err)
		}
		if n := len(resp.Events); n == 0 || resp.Events[n-1].Kv.ModRevision <= rev {
			continue // already listed
		}
		h, err := f.list(ctx)
		if err != nil {
			return rev, err
		}
		rev = h.Revision
	}
	return rev, errors.New("watch ended")
}

// wait waits for d, or until ctx ends: it reports whether ctx lives.
func wait(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
