package bench

import (
	"context"
	"errors"
	"fmt"
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

// benchWaitCandidates waits until n candidates are under the election key,
// or until done, if not nil, reports that the wait is moot.
func benchWaitCandidates(ctx context.Context, cli *clientv3.Client, key string, n int64, done func() bool) error {
	deadline := time.Now().Add(10 * time.Second)
	for done == nil || !done() {
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
	return nil
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

// benchResignRounds runs rounds of resignations on each side, and returns
// the samples of each: resign → successor leads. The successor campaigns
// settle before the resign.
func benchResignRounds(ctx context.Context, env *benchEnv, name string, rounds int, settle time.Duration) (c, p benchLatencies, err error) {
	sides := []string{"coord", "plain"}
	var pairs []*benchResignPair
	defer func() {
		for _, pr := range pairs {
			pr.close()
		}
	}()
	for _, side := range sides {
		pr := &benchResignPair{key: env.electionKey(name, side)}
		pairs = append(pairs, pr)
		if err := pr.start(ctx, env, side); err != nil {
			return nil, nil, err
		}
	}
	samples := make([]benchLatencies, len(pairs))
	for i := range rounds {
		// The sides take turns going first: neither gains from its place.
		for j := range pairs {
			k := (i + j) % len(pairs)
			d, err := pairs[k].round(ctx, env.cli, settle)
			if err != nil {
				return nil, nil, fmt.Errorf("%s: %w", sides[k], err)
			}
			samples[k] = append(samples[k], d)
		}
	}
	for _, pr := range pairs {
		_ = pr.leader.resign(ctx)
	}
	return samples[0], samples[1], nil
}

// benchResignPair is one side's pair of candidates of scenario 3, on
// clients of their own, handing leadership back and forth.
type benchResignPair struct {
	key              string
	leader, follower benchCandidate
}

// start creates the pair's candidates, and the leader leads.
func (p *benchResignPair) start(ctx context.Context, env *benchEnv, side string) error {
	for _, cand := range []*benchCandidate{&p.leader, &p.follower} {
		cli, err := env.client()
		if err != nil {
			return err
		}
		if *cand, err = newBenchCandidate(ctx, side, cli, p.key, coord.DefaultElectionTTL); err != nil {
			return err
		}
	}
	return p.leader.campaign(ctx)
}

// round queues the follower, waits settle once it is in line, resigns the
// leader and returns how long the follower took to lead; then they swap.
func (p *benchResignPair) round(ctx context.Context, cli *clientv3.Client, settle time.Duration) (time.Duration, error) {
	res := benchCampaignAsync(ctx, p.follower)
	if err := benchWaitCandidates(ctx, cli, p.key, 2, nil); err != nil {
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

func (p *benchResignPair) close() {
	if p.leader != nil {
		p.leader.close()
	}
	if p.follower != nil {
		p.follower.close()
	}
}

// benchLeaderCrash measures scenario 4: a leader crashes (its client is
// closed) and the candidate waiting behind it leads once etcd expires the
// leader's lease. Samples are crash → successor leads minus the granted
// TTL. Many elections run at once; their leaders crash at random moments.
func benchLeaderCrash(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	c, p, ttl, err := benchCrashSides(ctx, env, cfg, func(side string, ttl time.Duration) (benchCrashSamples, error) {
		return benchLeaderCrashSide(ctx, env, cfg, side, ttl)
	})
	if err != nil {
		return nil, err
	}
	return []benchRow{benchLatencyRow(
		fmt.Sprintf("4. Leader crash → successor leads: %d leaders crashed (client closed), TTL %s; latency − TTL, p50 / p99", cfg.leaderCrashes, benchSecs(ttl)),
		c.fromCrash, p.fromCrash, ttl, "≤ 500 ms, as row 1: the leader's lease expires at etcd's next expiry check"),
		benchCrashRenewalRow("4b. Leader crash → successor leads, same leaders", c, p),
	}, nil
}

// benchLeaderCrashSide runs one side of scenario 4: cfg.leaderCrashes
// elections, set up over about a second, whose leaders crash at random
// moments over cfg.crashSpan.
func benchLeaderCrashSide(ctx context.Context, env *benchEnv, cfg Config, side string, ttl time.Duration) (out benchCrashSamples, err error) {
	races := make([]*benchFailover, 0, cfg.leaderCrashes)
	defer func() {
		for _, r := range races {
			r.close()
		}
	}()
	for i := range cfg.leaderCrashes {
		// Spread over about a second, as in scenario 1.
		if err := benchStaggerSetup(ctx, cfg.leaderCrashes); err != nil {
			return out, err
		}
		r := &benchFailover{key: env.electionKey("failover", side, fmt.Sprint(i))}
		if r.cli, err = env.client(r.cnt.dialOptions()...); err != nil {
			return out, err
		}
		races = append(races, r)
		if err := r.start(ctx, env, cfg, side); err != nil {
			return out, err
		}
	}
	env.progress("scenario 4 (%s): set up", side)
	for _, r := range races {
		// Unless the leader lost its lease already (then the successor
		// leads, and the race is not counted), wait for the successor.
		if err := benchWaitCandidates(ctx, env.cli, r.key, 2, func() bool { return len(r.res) > 0 }); err != nil {
			return out, err
		}
	}
	if err := benchSleep(ctx, 3*ttl/2); err != nil {
		return out, err
	}
	if err := benchAtRandom(ctx, len(races), cfg.crashSpan, func(i int) { races[i].crash() }); err != nil {
		return out, err
	}
	return benchFailoverSamples(ctx, env, side, races, ttl)
}

// benchFailover is one election of scenario 4: a leader on a client of its
// own, which crashes, and a successor queued behind it on the shared
// client.
type benchFailover struct {
	cli              *clientv3.Client
	cnt              benchRPCCounter // when the leader's client last renewed
	key              string
	leader, follower benchCandidate
	res              <-chan benchCampaignResult // the successor's campaign
	crashed          benchCrash
	counted          bool // the leader led until its crash
}

// start has the leader lead, and queues the successor.
func (r *benchFailover) start(ctx context.Context, env *benchEnv, cfg Config, side string) (err error) {
	if r.leader, err = newBenchCandidate(ctx, side, r.cli, r.key, cfg.crashTTL); err != nil {
		return err
	}
	if err := r.leader.campaign(ctx); err != nil {
		return err
	}
	// The successor's session outlives the test: its TTL is not measured.
	if r.follower, err = newBenchCandidate(ctx, side, env.cli, r.key, coord.DefaultElectionTTL); err != nil {
		return err
	}
	r.res = benchCampaignAsync(ctx, r.follower)
	return nil
}

// crash crashes the leader. One that lost its lease early (a stall on a
// loaded machine) is no crash to measure.
func (r *benchFailover) crash() {
	r.counted = r.leader.leads() && len(r.res) == 0
	r.crashed = benchCrashClient(r.cli, &r.cnt)
}

func (r *benchFailover) close() {
	if r.follower != nil {
		_ = r.follower.resign(context.Background())
		r.follower.close()
	}
	_ = r.cli.Close()
	if r.leader != nil {
		r.leader.close()
	}
}

// benchFailoverSamples waits for the successors of the crashed leaders, and
// returns the samples of those counted.
func benchFailoverSamples(ctx context.Context, env *benchEnv, side string, races []*benchFailover, ttl time.Duration) (out benchCrashSamples, err error) {
	var uncounted int
	timeout := time.After(ttl + 10*time.Second)
	for _, r := range races {
		select {
		case res := <-r.res:
			if res.err != nil {
				return out, res.err
			}
			if !r.counted {
				uncounted++
				continue
			}
			out.add(res.at, r.crashed, ttl)
		case <-timeout:
			return out, fmt.Errorf("bench: successor of %s not leading %v after the crash", r.key, ttl+10*time.Second)
		case <-ctx.Done():
			return out, ctx.Err()
		}
	}
	if uncounted > 0 {
		env.progress("scenario 4 (%s): %d leaders had lost leadership before their crash; not counted", side, uncounted)
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
