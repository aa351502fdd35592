package bench

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// benchScale measures scenario 5: a watcher starts on a prefix holding n
// registered hosts. Time from NewHostWatcher to Synced, with a consumer
// reading every synthetic Up, against a plain Get, decoding every host
// into a map, then Watch; and the heap each keeps per host once synced
// (runtime.MemStats.HeapAlloc after GC, before and after). The sides
// alternate; the median of the repetitions is reported.
func benchScale(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	var rows []benchRow
	for _, n := range cfg.scaleSizes {
		r, err := benchScaleSize(ctx, env, cfg, n)
		if err != nil {
			return rows, err
		}
		rows = append(rows, r...)
	}
	return rows, nil
}

func benchScaleSize(ctx context.Context, env *benchEnv, cfg Config, n int) ([]benchRow, error) {
	prefix := env.prefix("scale", fmt.Sprint(n))
	g, err := env.cli.Grant(ctx, 3600)
	if err != nil {
		return nil, err
	}
	// Revoking the lease deletes every host at once.
	defer func() { _, _ = env.cli.Revoke(context.Background(), g.ID) }()
	t := time.Now()
	if err := benchPutHosts(ctx, env.cli, prefix, "scale", n, g.ID); err != nil {
		return nil, err
	}
	env.progress("scenario 5: %s hosts written in %v", benchCount(n), time.Since(t).Round(time.Millisecond))
	var ct, pt, ch, ph []float64
	for rep := range cfg.scaleReps {
		d, heap, err := benchScaleCoord(ctx, env.cli, prefix, n)
		if err != nil {
			return nil, fmt.Errorf("coord: %w", err)
		}
		ct, ch = append(ct, d.Seconds()), append(ch, heap)
		d2, heap2, err := benchScalePlain(ctx, env.cli, prefix, n)
		if err != nil {
			return nil, fmt.Errorf("plain: %w", err)
		}
		pt, ph = append(pt, d2.Seconds()), append(ph, heap2)
		env.progress("scenario 5: %s hosts, rep %d: coord %v %.0f B/host, plain %v %.0f B/host",
			benchCount(n), rep+1, d.Round(time.Millisecond), heap, d2.Round(time.Millisecond), heap2)
	}
	mc, mp := benchMedian(ct), benchMedian(pt)
	hc, hp := benchMedian(ch), benchMedian(ph)
	return []benchRow{
		{
			scenario: fmt.Sprintf("5. Watcher scale, %s registered hosts: NewHostWatcher → Synced (all synthetic Ups read) vs Get + decode + Watch; median of %d", benchCount(n), cfg.scaleReps),
			coord:    fmt.Sprintf("%s ms", benchMs(time.Duration(mc*float64(time.Second)))),
			plain:    fmt.Sprintf("%s ms", benchMs(time.Duration(mp*float64(time.Second)))),
			ratio:    benchRatio(mc, mp, "time"),
			limit:    fmt.Sprintf("aim (at 100,000): ratio ≤ 1.15; floor: the Get and the JSON decoding of every host (the plain column); coord lists in pages of %s keys", benchCount(coord.DefaultWatcherPageSize)),
		},
		{
			scenario: fmt.Sprintf("5. Watcher scale, %s registered hosts: heap per host once synced (coord's view vs the plain map)", benchCount(n)),
			coord:    fmt.Sprintf("%.0f B", hc),
			plain:    fmt.Sprintf("%.0f B", hp),
			ratio:    benchRatio(hc, hp, "bytes"),
			limit:    "aim ≤ 1.2; the decoded HostMetadata, its key and a map entry (the plain column)",
		},
	}, nil
}

// benchHeapNow returns the live heap after a full collection.
func benchHeapNow() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// benchScaleCoord starts a coord watcher on n hosts, reads its synthetic Ups
// and returns the time to Synced and the heap per host once synced. The
// consumer keeps no copy: the watcher's view (Hosts) is the replica.
func benchScaleCoord(ctx context.Context, cli *clientv3.Client, prefix string, n int) (time.Duration, float64, error) {
	h0 := benchHeapNow()
	t0 := time.Now()
	w, err := coord.NewHostWatcher(ctx, cli, coord.WatcherOptions{Prefix: prefix})
	if err != nil {
		return 0, 0, err
	}
	defer w.Close()
	all := make(chan struct{})
	go func() {
		seen := 0
		for range w.Events() {
			if seen++; seen == n {
				close(all)
			}
		}
	}()
	timeout := time.After(time.Minute)
	select {
	case <-w.Synced():
	case <-timeout:
		return 0, 0, errors.New("bench: watcher not synced after a minute")
	}
	d := time.Since(t0)
	select {
	case <-all:
	case <-timeout:
		return 0, 0, errors.New("bench: synthetic Ups missing")
	}
	heap := float64(benchHeapNow()-h0) / float64(n)
	return d, heap, nil
}

// benchScalePlain is what a user writes without coord (benchPlainWatch):
// Get, decode every host into a map, Watch from the next revision (a
// goroutine keeps the map up to date). It returns the time until the watch
// is started and the heap per host then.
func benchScalePlain(ctx context.Context, cli *clientv3.Client, prefix string, n int) (time.Duration, float64, error) {
	h0 := benchHeapNow()
	t0 := time.Now()
	listed, stop, err := benchPlainWatch(ctx, cli, prefix, func(coord.HostEventKind, string, int64, time.Time) {})
	if err != nil {
		return 0, 0, err
	}
	defer stop()
	d := time.Since(t0)
	if listed != n {
		return 0, 0, fmt.Errorf("bench: listed %d hosts, want %d", listed, n)
	}
	heap := float64(benchHeapNow()-h0) / float64(n)
	return d, heap, nil
}

// benchChurn measures scenario 6: hosts flap (key deleted, then put again)
// at a fixed rate while a coord watcher and a plain one follow them, both
// at once, each on its own client: the same writes, and the same noise of
// a shared machine, for both. The lag of an event is the time from the
// writer's acknowledgement of its revision to its delivery to the
// consumer, 0 when the event arrived first.
func benchChurn(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	prefix := env.prefix("churn")
	g, err := env.cli.Grant(ctx, 3600)
	if err != nil {
		return nil, err
	}
	defer func() { _, _ = env.cli.Revoke(context.Background(), g.ID) }()
	if err := benchPutHosts(ctx, env.cli, prefix, "churn", cfg.churnHosts, g.ID); err != nil {
		return nil, err
	}
	var clis [3]*clientv3.Client // the writer's, coord's, plain's
	for i := range clis {
		if clis[i], err = env.client(); err != nil {
			return nil, err
		}
		defer clis[i].Close()
	}
	log := newChurnLog()
	stop, err := log.follow(ctx, clis[1], clis[2], prefix)
	if err != nil {
		return nil, err
	}
	defer stop()
	rate, err := benchChurnWrites(ctx, clis[0], cfg, prefix, g.ID, log.ack)
	if err != nil {
		return nil, err
	}
	env.progress("scenario 6: %d writes at %.0f/s", log.writes(), rate)
	if err := log.waitDelivered(ctx, 10*time.Second); err != nil {
		return nil, err
	}
	lags := log.lags()
	return []benchRow{benchLatencyRow(
		fmt.Sprintf("6. Churn: %s hosts flapping (delete, put) at %d writes/s for %s, both watchers at once; lag from the writer's ack of the revision to the event's delivery (0 if first), p50 / p99",
			benchCount(cfg.churnHosts), cfg.churnRate, benchSecs(cfg.churnFor)),
		lags[0], lags[1], 0,
		"etcd's watch delivery (the plain column); coord adds a decode and a channel hop")}, nil
}

// churnLog records when the writer had each revision acknowledged, and
// when each side's consumer had it delivered.
type churnLog struct {
	mu        sync.Mutex
	acked     map[int64]time.Time
	delivered [2]map[int64]time.Time // coord's, plain's
}

func newChurnLog() *churnLog {
	return &churnLog{acked: map[int64]time.Time{}, delivered: [2]map[int64]time.Time{{}, {}}}
}

func (l *churnLog) ack(rev int64, at time.Time) {
	l.mu.Lock()
	l.acked[rev] = at
	l.mu.Unlock()
}

func (l *churnLog) deliver(side int, rev int64, at time.Time) {
	l.mu.Lock()
	l.delivered[side][rev] = at
	l.mu.Unlock()
}

func (l *churnLog) writes() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.acked)
}

// follow starts both watchers of prefix, coord's on coordCli and the plain
// one on plainCli, recording their deliveries; stop ends both.
func (l *churnLog) follow(ctx context.Context, coordCli, plainCli *clientv3.Client, prefix string) (stop func(), err error) {
	stopCoord, err := benchWatchCoord(ctx, coordCli, prefix, func(ev coord.HostEvent) {
		if !ev.Synthetic {
			l.deliver(0, ev.Revision, time.Now())
		}
	})
	if err != nil {
		return nil, fmt.Errorf("coord: %w", err)
	}
	_, stopPlain, err := benchPlainWatch(ctx, plainCli, prefix, func(_ coord.HostEventKind, _ string, rev int64, at time.Time) {
		l.deliver(1, rev, at)
	})
	if err != nil {
		stopCoord()
		return nil, fmt.Errorf("plain: %w", err)
	}
	return func() { stopPlain(); stopCoord() }, nil
}

// waitDelivered waits, up to timeout, for every acknowledged revision to
// reach both consumers.
func (l *churnLog) waitDelivered(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		missing := l.missing()
		if missing == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench: %d events not delivered %v after the churn", missing, timeout)
		}
		if err := benchSleep(ctx, 10*time.Millisecond); err != nil {
			return err
		}
	}
}

func (l *churnLog) missing() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for rev := range l.acked {
		for _, d := range l.delivered {
			if _, ok := d[rev]; !ok {
				n++
			}
		}
	}
	return n
}

// lags returns each side's lags: from a revision's acknowledgement to its
// delivery, 0 when the event arrived first.
func (l *churnLog) lags() [2]benchLatencies {
	l.mu.Lock()
	defer l.mu.Unlock()
	var lags [2]benchLatencies
	for rev, at := range l.acked {
		for i, d := range l.delivered {
			lags[i] = append(lags[i], max(d[rev].Sub(at), 0))
		}
	}
	return lags
}

// benchChurnWrites flaps the hosts under prefix at cfg.churnRate writes
// per second for cfg.churnFor, reporting each write's revision and when
// it was acknowledged, and returns the rate achieved. Writers each pace
// their share of the rate over hosts of their own, so that each host's
// writes stay in order.
func benchChurnWrites(ctx context.Context, cli *clientv3.Client, cfg Config, prefix string, lease clientv3.LeaseID, ack func(rev int64, at time.Time)) (float64, error) {
	const writers = 8
	keys := make([]string, cfg.churnHosts)
	vals := make([]string, cfg.churnHosts)
	for i := range keys {
		m := benchMeta("churn", i)
		keys[i], vals[i] = prefix+m.HostUUID, benchValue(m)
	}
	interval := time.Duration(float64(time.Second) * writers / float64(cfg.churnRate))
	start := time.Now()
	var wg sync.WaitGroup
	var writes [writers]int
	errs := make([]error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			gone := map[int]bool{} // hosts deleted, to put back next
			for k := 0; ; k++ {
				next := start.Add(time.Duration(k)*interval + time.Duration(w)*interval/writers)
				if next.Sub(start) >= cfg.churnFor {
					return
				}
				if errs[w] = benchSleep(ctx, time.Until(next)); errs[w] != nil {
					return
				}
				i := w + writers*(k%(cfg.churnHosts/writers))
				var rev int64
				if gone[i] {
					r, err := cli.Put(ctx, keys[i], vals[i], clientv3.WithLease(lease))
					if errs[w] = err; err != nil {
						return
					}
					rev = r.Header.Revision
				} else {
					r, err := cli.Delete(ctx, keys[i])
					if errs[w] = err; err != nil {
						return
					}
					rev = r.Header.Revision
				}
				ack(rev, time.Now())
				gone[i] = !gone[i]
				writes[w]++
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	total := 0
	for _, n := range writes {
		total += n
	}
	return float64(total) / took.Seconds(), nil
}
