package coord_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/go-coord/coord"
)

// Wiring coord's signals to Prometheus: counters by kind, and a gauge that
// says whether we lead. coord itself imports no metrics library.
func ExampleSignal_prometheus() {
	cli, done := exampleEtcd()
	defer done()
	ctx := context.Background()

	reg := prometheus.NewRegistry()
	signals := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "coord_signals_total", Help: "coord state changes and counts, by kind.",
	}, []string{"kind"})
	leading := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "coord_leading", Help: "1 while this agent leads the election.",
	}, []string{"key"})
	reg.MustRegister(signals, leading)
	onSignal := func(s coord.Signal) {
		signals.WithLabelValues(s.Kind.String()).Inc()
		switch s.Kind {
		case coord.SignalLeadershipGained:
			leading.WithLabelValues(s.Key).Set(1)
		case coord.SignalLeadershipLost:
			leading.WithLabelValues(s.Key).Set(0)
		}
	}

	h, err := coord.RegisterHostLiveness(ctx, cli, coord.HostMetadata{HostUUID: "3f1c"},
		coord.LivenessOptions{TTL: time.Second, OnSignal: onSignal})
	if err != nil {
		log.Fatal(err)
	}
	w, err := coord.NewHostWatcher(ctx, cli, coord.WatcherOptions{OnSignal: onSignal})
	if err != nil {
		log.Fatal(err)
	}
	exampleEvent(w) // the synthetic Up of 3f1c
	e, err := coord.NewElection(ctx, cli, coord.ElectionOptions{Key: "/coord/elections/scheduler", TTL: time.Second, OnSignal: onSignal})
	if err != nil {
		log.Fatal(err)
	}
	if err := e.Campaign(ctx, "node-1"); err != nil {
		log.Fatal(err)
	}
	fmt.Println("leading:", value(leading.WithLabelValues("/coord/elections/scheduler")))
	done2 := e.Done()
	e.Close()
	<-done2
	s, err := coord.NewSemaphore(ctx, cli, coord.SemaphoreOptions{Key: "/coord/semaphores/maintenance", Limit: 2, TTL: time.Second, OnSignal: onSignal})
	if err != nil {
		log.Fatal(err)
	}
	for range 2 {
		p, err := s.Acquire(ctx)
		if err != nil {
			log.Fatal(err)
		}
		if err := p.Release(ctx); err != nil {
			log.Fatal(err)
		}
		<-p.Done()
	}
	s.Close() // waits for the permits' ends to be signalled
	w.Close()
	h.Stop(ctx)

	for _, kind := range []string{"registered", "event-delivered", "leadership-gained", "leadership-lost",
		"permit-acquired", "permit-released", "registration-ended"} {
		fmt.Printf("%s: %v\n", kind, value(signals.WithLabelValues(kind)))
	}
	fmt.Println("leading:", value(leading.WithLabelValues("/coord/elections/scheduler")))
	// Output:
	// leading: 1
	// registered: 1
	// event-delivered: 1
	// leadership-gained: 1
	// leadership-lost: 1
	// permit-acquired: 2
	// permit-released: 2
	// registration-ended: 1
	// leading: 0
}

// value reads a counter's or gauge's current value.
func value(m prometheus.Metric) float64 {
	var out dto.Metric
	if err := m.Write(&out); err != nil {
		log.Fatal(err)
	}
	return out.GetCounter().GetValue() + out.GetGauge().GetValue()
}
