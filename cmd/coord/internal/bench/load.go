package bench

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/go-coord/coord"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"google.golang.org/grpc"
)

// benchRPCCounter counts, on one client, what etcd receives from it about
// leases: every LeaseKeepAlive request (each renewal), the LeaseKeepAlive
// streams opened, and the leases granted and revoked. It sits below the
// client's retry interceptor, so it counts what goes on the wire.
type benchRPCCounter struct {
	keepAlives atomic.Int64
	streams    atomic.Int64
	grants     atomic.Int64
	revokes    atomic.Int64
	lastSend   atomic.Int64 // when the latest LeaseKeepAlive was sent, in Unix ns
}

func (c *benchRPCCounter) dialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			s, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil || method != pb.Lease_LeaseKeepAlive_FullMethodName {
				return s, err
			}
			c.streams.Add(1)
			return benchCountingStream{ClientStream: s, c: c}, nil
		}),
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			err := invoker(ctx, method, req, reply, cc, opts...)
			if err == nil {
				switch method {
				case pb.Lease_LeaseGrant_FullMethodName:
					c.grants.Add(1)
				case pb.Lease_LeaseRevoke_FullMethodName:
					c.revokes.Add(1)
				}
			}
			return err
		}),
	}
}

type benchCountingStream struct {
	grpc.ClientStream
	c *benchRPCCounter
}

func (s benchCountingStream) SendMsg(m any) error {
	t := time.Now()
	err := s.ClientStream.SendMsg(m)
	if err == nil {
		s.c.keepAlives.Add(1)
		s.c.lastSend.Store(t.UnixNano())
	}
	return err
}

// sinceRenewal returns how long before t the latest renewal was sent, and
// false if none was.
func (c *benchRPCCounter) sinceRenewal(t time.Time) (time.Duration, bool) {
	last := c.lastSend.Load()
	if last == 0 {
		return 0, false
	}
	return t.Sub(time.Unix(0, last)), true
}

// benchLoadResult is what one side of scenario 7 cost etcd over the window.
type benchLoadResult struct {
	keepAlives, streams float64 // per second
	leases              int64   // held during the window
	cpu                 float64 // this process, ms per s
	cpuOK               bool
}

// benchLoadWorkers is how many campaigns of scenario 7 are in flight at
// once while a side sets up: a host taking its keys at start.
const benchLoadWorkers = 32

// benchPoolSessions is how many sessions an ElectionPool holds for keys
// elections, with its default KeysPerSession.
func benchPoolSessions(keys int) int {
	return (keys + coord.DefaultKeysPerSession - 1) / coord.DefaultKeysPerSession
}

// benchLoad measures scenario 7: one host with its liveness and
// cfg.loadKeys pooled election keys (each campaigned, so the host leads
// them all), and what that costs etcd in leases and renewals, and this
// process in CPU. coord: a HostLiveness and an ElectionPool with its
// default KeysPerSession. plain: Grant + KeepAlive + Put, and one
// concurrency session per coord.DefaultKeysPerSession keys, an election
// per key on it: the pool's layout, written by hand. The sides run one
// after the other, so that the process CPU time of each can be told apart.
func benchLoad(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	// What the process burns with nothing to do, for comparison.
	idle, err := startBenchMeter(ctx, nil, cfg.loadWindow/3)
	if err != nil {
		return nil, err
	}
	idleCPU, _, _, _ := idle.read()
	c, p, err := benchInTurn(ctx, env, func(side string) (benchLoadResult, error) { return benchLoadSide(ctx, env, cfg, side) })
	if err != nil {
		return nil, err
	}
	rows := benchLoadRows(cfg, c, p)
	if idle.cpuOK && c.cpuOK && p.cpuOK {
		rows = append(rows, benchRow{
			scenario: "7. etcd load, same host: CPU of this process (client" + map[bool]string{true: " + embedded etcd", false: ""}[env.embedded] + ") during the window, ms per s",
			coord:    fmt.Sprintf("%.1f ms/s", c.cpu),
			plain:    fmt.Sprintf("%.1f ms/s", p.cpu),
			ratio:    benchRatio(c.cpu, p.cpu, "CPU"),
			limit:    fmt.Sprintf("aim: ratio ≤ 1.2; %.1f ms/s idle (nothing registered)", idleCPU),
		})
	}
	return rows, nil
}

// benchLoadRows are the rows of what the host asks of etcd.
func benchLoadRows(cfg Config, c, p benchLoadResult) []benchRow {
	// What the layout needs: a lease per KeysPerSession keys and the
	// registration's, each renewed every third of its TTL, on one
	// long-lived stream.
	sessions := benchPoolSessions(cfg.loadKeys)
	rate := float64(sessions)*3/cfg.loadPoolTTL.Seconds() + 3/cfg.loadLivenessTTL.Seconds()
	setup := fmt.Sprintf("one host: liveness (TTL %s) + %s pooled election keys (TTL %s, %s keys per lease), led",
		benchSecs(cfg.loadLivenessTTL), benchCount(cfg.loadKeys), benchSecs(cfg.loadPoolTTL), benchCount(coord.DefaultKeysPerSession))
	return []benchRow{
		{
			scenario: fmt.Sprintf("7. etcd load, %s: LeaseKeepAlive requests/s over %s", setup, benchSecs(cfg.loadWindow)),
			coord:    fmt.Sprintf("%.2f/s", c.keepAlives),
			plain:    fmt.Sprintf("%.2f/s", p.keepAlives),
			ratio:    benchRatio(c.keepAlives, p.keepAlives, "requests/s"),
			limit: fmt.Sprintf("%.2f/s: %s every TTL/3 = %s, the registration's every %s",
				rate, benchPlural(sessions, "session lease"), benchSecs(cfg.loadPoolTTL/3), benchSecs(cfg.loadLivenessTTL/3)),
		},
		{
			scenario: "7. etcd load, same host: LeaseKeepAlive streams opened/s once set up",
			coord:    fmt.Sprintf("%.2f/s", c.streams),
			plain:    fmt.Sprintf("%.2f/s", p.streams),
			ratio:    benchRatio(c.streams, p.streams, "streams/s"),
			limit:    "0/s: one long-lived stream per client carries every renewal",
		},
		{
			scenario: "7. etcd load, same host: leases held",
			coord:    fmt.Sprint(c.leases),
			plain:    fmt.Sprint(p.leases),
			ratio:    benchRatio(float64(c.leases), float64(p.leases), "leases"),
			limit: fmt.Sprintf("%d: ceil(%s / %s) session leases + the registration's",
				sessions+1, benchCount(cfg.loadKeys), benchCount(coord.DefaultKeysPerSession)),
		},
	}
}

// benchLoadSide sets up one side of scenario 7 on a client of its own, and
// counts what it sends over the window.
func benchLoadSide(ctx context.Context, env *benchEnv, cfg Config, side string) (benchLoadResult, error) {
	var cnt benchRPCCounter
	cli, err := env.client(cnt.dialOptions()...)
	if err != nil {
		return benchLoadResult{}, err
	}
	defer cli.Close()
	prefix := env.prefix("load", side)
	m := benchMeta(side, 0)
	key := func(i int) string { return env.electionKey("load", side+"-elections", fmt.Sprint(i)) }
	t := time.Now()
	var stop func()
	if side == "coord" {
		stop, err = benchLoadCoord(ctx, cli, cfg, prefix, m, key)
	} else {
		stop, err = benchLoadPlain(ctx, cli, cfg, prefix, m, key)
	}
	if stop != nil {
		defer stop()
	}
	if err != nil {
		return benchLoadResult{}, err
	}
	env.progress("scenario 7 (%s): set up in %v; counting for %v", side, time.Since(t).Round(time.Millisecond), cfg.loadWindow)
	// Count once the registration's first renewal is out: a renewal
	// stream opened then is part of starting up.
	if err := benchSleep(ctx, time.Until(t.Add(cfg.loadLivenessTTL/3+500*time.Millisecond))); err != nil {
		return benchLoadResult{}, err
	}
	leases := cnt.grants.Load() - cnt.revokes.Load()
	ka0, st0 := cnt.keepAlives.Load(), cnt.streams.Load()
	meter, err := startBenchMeter(ctx, nil, cfg.loadWindow)
	if err != nil {
		return benchLoadResult{}, err
	}
	cpu, _, _, _ := meter.read()
	w := cfg.loadWindow.Seconds()
	return benchLoadResult{
		keepAlives: float64(cnt.keepAlives.Load()-ka0) / w,
		streams:    float64(cnt.streams.Load()-st0) / w,
		leases:     leases,
		cpu:        cpu,
		cpuOK:      meter.cpuOK,
	}, nil
}

// benchLoadCoord sets up coord's side of scenario 7: a HostLiveness and an
// ElectionPool leading every key. stop releases them, also after an error.
func benchLoadCoord(ctx context.Context, cli *clientv3.Client, cfg Config, prefix string, m coord.HostMetadata, key func(int) string) (stop func(), err error) {
	h, err := coord.RegisterHostLiveness(ctx, cli, m, coord.LivenessOptions{Prefix: prefix, TTL: cfg.loadLivenessTTL})
	if err != nil {
		return nil, err
	}
	pool, err := coord.NewElectionPool(cli, coord.PoolOptions{TTL: cfg.loadPoolTTL, Identity: m.Hostname})
	if err != nil {
		_ = h.Stop(context.Background())
		return nil, err
	}
	stop = func() {
		_ = pool.Close()
		_ = h.Stop(context.Background())
	}
	return stop, benchParallel(ctx, cfg.loadKeys, benchLoadWorkers, func(i int) error {
		e, err := pool.Election(ctx, key(i))
		if err != nil {
			return err
		}
		return e.Campaign(ctx, "")
	})
}

// benchLoadPlain sets up the plain side of scenario 7: Grant + KeepAlive +
// Put for the host, and a concurrency session per
// coord.DefaultKeysPerSession keys, leading each key with an election on
// it. stop releases them, also after an error.
func benchLoadPlain(ctx context.Context, cli *clientv3.Client, cfg Config, prefix string, m coord.HostMetadata, key func(int) string) (stop func(), err error) {
	kctx, cancel := context.WithCancel(context.Background())
	var lease clientv3.LeaseID
	var sessions []*concurrency.Session
	stop = func() {
		for _, s := range sessions {
			_ = s.Close()
		}
		cancel()
		if lease != clientv3.NoLease {
			_, _ = cli.Revoke(context.Background(), lease)
		}
	}
	if lease, _, err = benchPlainRegister(ctx, kctx, cli, prefix+m.HostUUID, m, cfg.loadLivenessTTL); err != nil {
		return stop, err
	}
	for range benchPoolSessions(cfg.loadKeys) {
		s, err := concurrency.NewSession(cli, concurrency.WithTTL(int(cfg.loadPoolTTL/time.Second)), concurrency.WithContext(context.Background()))
		if err != nil {
			return stop, err
		}
		sessions = append(sessions, s)
	}
	return stop, benchParallel(ctx, cfg.loadKeys, benchLoadWorkers, func(i int) error {
		return concurrency.NewElection(sessions[i/coord.DefaultKeysPerSession], key(i)).Campaign(ctx, m.Hostname)
	})
}
