package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// benchCandidate is one side's way to run for an election: coord's Election,
// or what a user writes with etcd's concurrency package.
type benchCandidate interface {
	campaign(ctx context.Context) error
	resign(ctx context.Context) error
	// leads reports whether we still lead, as far as the side can tell.
	leads() bool
	close()
}

func newBenchCandidate(ctx context.Context, side string, cli *clientv3.Client, key string, ttl time.Duration) (benchCandidate, error) {
	if side == "coord" {
		e, err := coord.NewElection(ctx, cli, coord.ElectionOptions{Key: key, TTL: ttl, Identity: "bench"})
		if err != nil {
			return nil, err
		}
		return benchCoordCandidate{e}, nil
	}
	s, err := concurrency.NewSession(cli, concurrency.WithTTL(int(ttl/time.Second)), concurrency.WithContext(context.Background()))
	if err != nil {
		return nil, err
	}
	return &benchPlainCandidate{s: s, e: concurrency.NewElection(s, key)}, nil
}

type benchCoordCandidate struct{ e *coord.Election }

func (c benchCoordCandidate) campaign(ctx context.Context) error { return c.e.Campaign(ctx, "") }
func (c benchCoordCandidate) resign(ctx context.Context) error   { return c.e.Resign(ctx) }
func (c benchCoordCandidate) leads() bool                        { return c.e.IsLeader() }
func (c benchCoordCandidate) close()                             { _ = c.e.Close() }

type benchPlainCandidate struct {
	s *concurrency.Session
	e *concurrency.Election
}

func (c *benchPlainCandidate) campaign(ctx context.Context) error { return c.e.Campaign(ctx, "bench") }
func (c *benchPlainCandidate) resign(ctx context.Context) error   { return c.e.Resign(ctx) }

func (c *benchPlainCandidate) leads() bool {
	select {
	case <-c.s.Done():
		return false
	default:
		return true
	}
}

func (c *benchPlainCandidate) close() {
	if c.s.Client().Ctx().Err() != nil {
		// A crashed client: Close would wait out its revoke's timeout.
		c.s.Orphan()
		return
	}
	_ = c.s.Close()
}

// benchCampaignResult is when a campaign returned, and how.
type benchCampaignResult struct {
	at  time.Time
	err error
}

// benchCampaignAsync campaigns in the background.
func benchCampaignAsync(ctx context.Context, c benchCandidate) <-chan benchCampaignResult {
	res := make(chan benchCampaignResult, 1)
	go func() {
		err := c.campaign(ctx)
		res <- benchCampaignResult{time.Now(), err}
	}()
	return res
}

// benchWaitCandidates waits until n candidates are under the election key.
func benchWaitCandidates(ctx context.Context, cli *clientv3.Client, key string, n int64) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		g, err := cli.Get(ctx, key+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			return err
		}
		if g.Count == n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench: %d candidates under %s, want %d", g.Count, key, n)
		}
		if err := benchSleep(ctx, time.Millisecond); err != nil {
			return err
		}
	}
}

// electionKey returns a fresh election key (no trailing "/").
func (env *benchEnv) electionKey(parts ...string) string {
	return strings.TrimSuffix(env.prefix(parts...), "/")
}

// benchResign measures scenario 3: the leader resigns and the candidate
// waiting behind it becomes leader. Each side's pair of candidates, on
// clients of their own, hand leadership back and forth; the sides
// alternate round by round. Twice: with a successor that has waited long
// enough for etcd to have synced its watch (etcd catches up watches that
// start at a past revision every 100 ms), and with one that queued just
// before the resign.
func benchResign(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	c, p, err := benchResignRounds(ctx, env, "resign", cfg.resignRounds, cfg.resignSettle)
	if err != nil {
		return nil, err
	}
	rows := []benchRow{benchLatencyRow(
		fmt.Sprintf("3. Resign → successor leads: %d resignations, successor waiting %s; coord Election vs concurrency.Election, p50 / p99",
			cfg.resignRounds, cfg.resignSettle),
		c, p, 0, "aim: ratio ≤ 1.1; floor: the delete, its watch event, one read confirming nobody is ahead")}
	if c, p, err = benchResignRounds(ctx, env, "resign-fresh", cfg.resignFreshRounds, cfg.resignFreshSettle); err != nil {
		return rows, err
	}
	return append(rows, benchLatencyRow(
		fmt.Sprintf("3b. Resign → successor leads: %d resignations, successor queued %s before; p50 / p99",
			cfg.resignFreshRounds, cfg.resignFreshSettle),
		c, p, 0, "as row 3; a watch from a past revision waits for etcd's 100 ms catch-up loop")), nil
}

func benchResignRounds(ctx context.Context, env *benchEnv, name string, rounds int, settle time.Duration) (c, p benchLatencies, err error) {
	type pair struct {
		key              string
		leader, follower benchCandidate
	}
	var pairs []*pair
	defer func() {
		for _, p := range pairs {
			if p.leader != nil {
				p.leader.close()
			}
			if p.follower != nil {
				p.follower.close()
			}
		}
	}()
	for _, side := range []string{"coord", "plain"} {
		pr := &pair{key: env.electionKey(name, side)}
		pairs = append(pairs, pr)
		for _, cand := range []*benchCandidate{&pr.leader, &pr.follower} {
			cli, err := env.client()
			if err != nil {
				return nil, nil, err
			}
			if *cand, err = newBenchCandidate(ctx, side, cli, pr.key, coord.DefaultElectionTTL); err != nil {
				return nil, nil, err
			}
		}
		if err := pr.leader.campaign(ctx); err != nil {
			return nil, nil, err
		}
	}
	round := func(p *pair) (time.Duration, error) {
		res := benchCampaignAsync(ctx, p.follower)
		if err := benchWaitCandidates(ctx, env.cli, p.key, 2); err != nil {
			return 0, err
		}
		if err := benchSleep(ctx, settle); err != nil {
			return 0, err
		}
		t0 := time.Now()
		if err := p.leader.resign(ctx); err != nil {
			return 0, err
		}
		select {
		case r := <-res:
			if r.err != nil {
				return 0, r.err
			}
			p.leader, p.follower = p.follower, p.leader
			return r.at.Sub(t0), nil
		case <-time.After(10 * time.Second):
			return 0, errors.New("bench: successor not leading 10 s after resign")
		}
	}
	for i := range rounds {
		// The sides take turns going first: neither gains from its place.
		for j := range pairs {
			k := (i + j) % len(pairs)
			d, err := round(pairs[k])
			if err != nil {
				return nil, nil, fmt.Errorf("%s: %w", []string{"coord", "plain"}[k], err)
			}
			if k == 0 {
				c = append(c, d)
			} else {
				p = append(p, d)
			}
		}
	}
	for _, p := range pairs {
		_ = p.leader.resign(ctx)
	}
	return c, p, nil
}

// benchLeaderCrash measures scenario 4: a leader crashes (its client is
// closed) and the candidate waiting behind it leads once etcd expires the
// leader's lease. Samples are crash → successor leads minus the granted
// TTL. Many elections run at once; their leaders crash at random moments.
func benchLeaderCrash(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	ttl, err := benchGrantedTTL(ctx, env.cli, cfg.crashTTL)
	if err != nil {
		return nil, err
	}
	c, p, err := benchBoth(
		func() (benchCrashSamples, error) { return benchLeaderCrashSide(ctx, env, cfg, "coord", ttl) },
		func() (benchCrashSamples, error) { return benchLeaderCrashSide(ctx, env, cfg, "plain", ttl) },
	)
	if err != nil {
		return nil, err
	}
	return []benchRow{benchLatencyRow(
		fmt.Sprintf("4. Leader crash → successor leads: %d leaders crashed (client closed), TTL %s; latency − TTL, p50 / p99", cfg.leaderCrashes, benchSecs(ttl)),
		c.fromCrash, p.fromCrash, ttl, "≤ 500 ms, as row 1: the leader's lease expires at etcd's next expiry check"),
		benchCrashRenewalRow("4b. Leader crash → successor leads, same leaders", c, p),
	}, nil
}

func benchLeaderCrashSide(ctx context.Context, env *benchEnv, cfg Config, side string, ttl time.Duration) (out benchCrashSamples, err error) {
	type race struct {
		cli              *clientv3.Client
		cnt              benchRPCCounter // when the leader's client last renewed
		key              string
		leader, follower benchCandidate
		res              <-chan benchCampaignResult
	}
	races := make([]*race, 0, cfg.leaderCrashes)
	defer func() {
		for _, r := range races {
			if r.follower != nil {
				_ = r.follower.resign(context.Background())
				r.follower.close()
			}
			_ = r.cli.Close()
			if r.leader != nil {
				r.leader.close()
			}
		}
	}()
	for i := range cfg.leaderCrashes {
		// Spread over about a second, as in scenario 1.
		if err := benchSleep(ctx, rand.N(2*time.Second/time.Duration(cfg.leaderCrashes))); err != nil {
			return out, err
		}
		r := &race{key: env.electionKey("failover", side, fmt.Sprint(i))}
		if r.cli, err = env.client(r.cnt.dialOptions()...); err != nil {
			return out, err
		}
		races = append(races, r)
		if r.leader, err = newBenchCandidate(ctx, side, r.cli, r.key, cfg.crashTTL); err != nil {
			return out, err
		}
		if err := r.leader.campaign(ctx); err != nil {
			return out, err
		}
		// The successor's session outlives the test: its TTL is not measured.
		if r.follower, err = newBenchCandidate(ctx, side, env.cli, r.key, coord.DefaultElectionTTL); err != nil {
			return out, err
		}
		r.res = benchCampaignAsync(ctx, r.follower)
	}
	env.progress("scenario 4 (%s): set up", side)
	for _, r := range races {
		// Unless the leader lost its lease already (then the successor
		// leads, and the race is not counted), wait for the successor.
		deadline := time.Now().Add(10 * time.Second)
		for len(r.res) == 0 {
			g, err := env.cli.Get(ctx, r.key+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
			if err != nil {
				return out, err
			}
			if g.Count == 2 {
				break
			}
			if time.Now().After(deadline) {
				return out, fmt.Errorf("bench: %d candidates under %s, want 2", g.Count, r.key)
			}
			if err := benchSleep(ctx, time.Millisecond); err != nil {
				return out, err
			}
		}
	}
	if err := benchSleep(ctx, 3*ttl/2); err != nil {
		return out, err
	}
	crashed := make([]time.Time, len(races))
	renewed := make([]time.Duration, len(races))
	valid := make([]bool, len(races))
	start := time.Now()
	for i, off := range benchCrashOffsets(len(races), cfg.crashSpan) {
		if err := benchSleep(ctx, time.Until(start.Add(off))); err != nil {
			return out, err
		}
		// A leader that lost its lease early (a stall on a loaded machine)
		// is no crash to measure.
		valid[i] = races[i].leader.leads() && len(races[i].res) == 0
		crashed[i] = time.Now()
		_ = races[i].cli.Close()
		renewed[i], _ = races[i].cnt.sinceRenewal(crashed[i])
	}
	var invalid int
	timeout := time.After(ttl + 10*time.Second)
	for i, r := range races {
		select {
		case res := <-r.res:
			if res.err != nil {
				return out, res.err
			}
			if !valid[i] {
				invalid++
				continue
			}
			out.fromCrash = append(out.fromCrash, res.at.Sub(crashed[i])-ttl)
			out.fromRenewal = append(out.fromRenewal, res.at.Sub(crashed[i])+renewed[i]-ttl)
		case <-timeout:
			return out, fmt.Errorf("bench: successor of %s not leading %v after the crash", r.key, ttl+10*time.Second)
		case <-ctx.Done():
			return out, ctx.Err()
		}
	}
	if invalid > 0 {
		env.progress("scenario 4 (%s): %d leaders had lost leadership before their crash; not counted", side, invalid)
	}
	return out, nil
}

// benchCampaign measures scenario 8: uncontended Campaign then Resign on
// one key, as fast as possible. The sides, and the floor (the two
// requests an uncontended etcd-concurrency campaign and resignation need,
// sent by hand), take turns chunk by chunk, so that they share the
// machine's noise.
func benchCampaign(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	floor := env.electionKey("campaign", "floor")
	cands := []benchCandidate{&benchFloorCandidate{cli: env.cli, prefix: floor + "/", key: floor + "/1"}}
	defer func() {
		for _, c := range cands {
			c.close()
		}
	}()
	for _, side := range []string{"coord", "plain"} {
		c, err := newBenchCandidate(ctx, side, env.cli, env.electionKey("campaign", side), coord.DefaultElectionTTL)
		if err != nil {
			return nil, err
		}
		cands = append(cands, c)
	}
	var n [3]int
	var took [3]time.Duration
	for chunks := 0; time.Duration(chunks)*cfg.campaignChunk < cfg.campaignFor; chunks++ {
		for j := range cands {
			// Each takes its turn first in its turn: no place in the order
			// is favoured.
			i := (chunks + j) % len(cands)
			c := cands[i]
			t0 := time.Now()
			for time.Since(t0) < cfg.campaignChunk {
				if err := c.campaign(ctx); err != nil {
					return nil, err
				}
				if err := c.resign(ctx); err != nil {
					return nil, err
				}
				n[i]++
			}
			took[i] += time.Since(t0)
		}
	}
	rate := func(i int) float64 { return float64(n[i]) / took[i].Seconds() }
	return []benchRow{{
		scenario: "8. Campaign throughput: uncontended Campaign + Resign on one key, one client, cycles/s",
		coord:    fmt.Sprintf("%.0f/s", rate(1)),
		plain:    fmt.Sprintf("%.0f/s", rate(2)),
		ratio:    benchRatio(rate(1), rate(2), "cycles/s; higher is better"),
		limit: fmt.Sprintf("%.0f/s: a campaign in one Txn (put-if-absent and a read of the first candidate) and a delete Txn, sent by hand, in turn with the sides",
			rate(0)),
	}}, nil
}

// benchFloorCandidate campaigns with the least an etcd-concurrency
// campaign needs, sent by hand: the floor of scenario 8. Uncontended, one
// Txn puts our key if absent and reads the first candidate, which is ours.
type benchFloorCandidate struct {
	cli         *clientv3.Client
	prefix, key string
}

func (c *benchFloorCandidate) campaign(ctx context.Context) error {
	first := clientv3.OpGet(c.prefix, clientv3.WithFirstCreate()...)
	_, err := c.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(c.key), "=", 0)).
		Then(clientv3.OpPut(c.key, "bench"), first).Else(first).Commit()
	return err
}

func (c *benchFloorCandidate) resign(ctx context.Context) error {
	_, err := c.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(c.key), ">", 0)).
		Then(clientv3.OpDelete(c.key)).Commit()
	return err
}

func (c *benchFloorCandidate) leads() bool { return true }
func (c *benchFloorCandidate) close()      {}
