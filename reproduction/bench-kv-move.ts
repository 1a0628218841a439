/**
 * KV mobility: time to first token (TTFT) of a follow-up turn whose prompt is a long history (the
 * previous turn's prompt and reply) plus a short new message, three ways —
 *   local hit  the node that served turn 1 runs turn 2 from the prefix it kept;
 *   pulled     another node runs turn 2: it pulls the history's KV from the first over
 *              /shoal/kv/1.0.0 (real libp2p nodes on loopback, TCP + noise + yamux) and prefills
 *              only the rest;
 *   recomputed a node without the prefix prefills everything.
 * The puller's link gets a simulated one-way latency per hop (`--delays`, the pipeline's delay-line
 * idea: each direction's messages arrive that much later, in order) and optionally a bandwidth cap
 * (`--bandwidth` bytes/s: messages are also spaced by their size over it). The request's own hop
 * from the ingress is the same for all three and left out. Every follow-up's greedy tokens are
 * checked against the recomputed one's. The cost model's verdict (shouldPull, with the rates
 * measured here) is printed beside each row.
 *
 *   node reproduction/bench-kv-move.ts [--size 60m] [--quant int4] [--history 2000] [--new 20] [--rounds 2] [--delays 0,20,100] [--bandwidth B] [--threads 1]
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { cpus, loadavg, tmpdir } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import type { Libp2p, Stream } from '@libp2p/interface'
import { tcp } from '@libp2p/tcp'
import { createLibp2p } from 'libp2p'
import { createLocalService } from '../daemon/engine/index.ts'
import type { LocalService } from '../daemon/engine/index.ts'
import { createKvPuller, kvBytesPerToken, pullCost, serveKv, shouldPull } from '../daemon/kv/index.ts'
import type { PullOutcome } from '../daemon/kv/index.ts'
import type { GenerateRequest, PrefixHolderHint } from '../daemon/service.ts'
import { compileShards, generateTestModel } from '../shards/index.ts'
import type { TestModelSize } from '../shards/testmodel/generate.ts'

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: '60m' },
    quant: { type: 'string', default: 'int4' },
    history: { type: 'string', default: '2000' },
    new: { type: 'string', default: '20' },
    rounds: { type: 'string', default: '2' },
    delays: { type: 'string', default: '0,20,100' },
    bandwidth: { type: 'string' },
    threads: { type: 'string', default: '1' },
  },
})
const HISTORY = Number(args.history)
const NEW = Number(args.new)
const ROUNDS = Number(args.rounds)
const DELAYS = args.delays.split(',').map(Number)
const BANDWIDTH = args.bandwidth === undefined ? undefined : Number(args.bandwidth)
const threads = Number(args.threads)

function tokens (n: number, seed: number, vocab: number): number[] {
  let x = seed * 2654435761 >>> 0
  return Array.from({ length: n }, () => { x = (x * 1103515245 + 12345) >>> 0; return 3 + (x >>> 8) % (Math.min(vocab, 500) - 3) })
}

/**
 * One direction of a simulated link: each message is delivered `ms` after it would have finished
 * crossing a link of `bytesPerSecond` (unlimited when undefined), in order.
 */
function createLink (ms: number, bytesPerSecond: number | undefined): (bytes: number, deliver: () => void) => void {
  let free = 0
  let last = 0
  return (bytes, deliver) => {
    const now = performance.now()
    const sent = bytesPerSecond === undefined ? now : Math.max(free, now) + bytes / bytesPerSecond * 1000
    free = sent
    // Never before an earlier message (timers of equal delay fire in order; this keeps it so).
    const at = Math.max(last, sent + ms)
    last = at
    if (at - now <= 0.5) deliver()
    else setTimeout(deliver, at - now)
  }
}

/** A stream whose incoming messages and end/close events, and outgoing sends, cross simulated links. */
function delayed (stream: Stream, ms: number, bytesPerSecond: number | undefined): Stream {
  if (ms <= 0 && bytesPerSecond === undefined) return stream
  const inbound = createLink(ms, bytesPerSecond)
  const outbound = createLink(ms, bytesPerSecond)
  type Listener = (evt: Event) => void
  const wrapped = new Map<unknown, Listener>()
  return new Proxy(stream, {
    get (target, prop) {
      if (prop === 'addEventListener') {
        return (type: string, listener: Listener, options?: { once?: boolean }) => {
          const w: Listener = (evt) => {
            const size = type === 'message' ? (evt as unknown as { data: { byteLength: number } }).data.byteLength : 0
            inbound(size, () => listener(evt))
          }
          wrapped.set(listener, w)
          target.addEventListener(type as 'message', w as never, options)
        }
      }
      if (prop === 'removeEventListener') {
        return (type: string, listener: Listener) => { target.removeEventListener(type as 'message', (wrapped.get(listener) ?? listener) as never) }
      }
      if (prop === 'send') {
        // The bytes are queued on the link and sent when they would have crossed it; the caller sees no back-pressure.
        return (data: { byteLength: number }) => { outbound(data.byteLength, () => { if (target.writeStatus === 'writable') target.send(data as never) }); return true }
      }
      const v = Reflect.get(target, prop, target) as unknown
      return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v
    },
  })
}

async function node (): Promise<Libp2p> {
  return await createLibp2p({
    addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
    transports: [tcp()],
    connectionEncrypters: [noise()],
    streamMuxers: [yamux()],
    connectionMonitor: { enabled: false },
  })
}

let counter = 0
async function turn (svc: LocalService, ids: number[], maxTokens: number, hint?: PrefixHolderHint): Promise<{ ttftMs: number, tokens: number[], prefix: string | undefined }> {
  const req: GenerateRequest = {
    requestId: `k${++counter}`, model: 'bench', prompt: { kind: 'tokens', ids }, maxTokens, sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 600_000,
    ...(hint === undefined ? {} : { prefixHolder: hint }),
  }
  const t0 = performance.now()
  let ttft = 0
  let prefix: string | undefined
  const out: number[] = []
  for await (const ev of svc.generate(req, new AbortController().signal)) {
    if (ev.type === 'start') prefix = ev.prefix === undefined ? undefined : ev.prefix.movedFrom === undefined ? 'reused' : 'moved'
    if (ev.type === 'delta') { if (ttft === 0) ttft = performance.now() - t0; out.push(...ev.tokenIds) }
  }
  return { ttftMs: ttft, tokens: out, prefix }
}

const median = (xs: number[]): number => [...xs].sort((a, b) => a - b)[Math.floor((xs.length - 1) / 2)]!

const dir = await mkdtemp(join(tmpdir(), 'shoal-bench-kv-move-'))
const stops: Array<() => Promise<void>> = []
try {
  await generateTestModel({ architecture: 'llama', outDir: join(dir, 'ckpt'), size: args.size as TestModelSize })
  const manifest = await compileShards({ modelDir: join(dir, 'ckpt'), outDir: join(dir, 'shard'), modelId: 'bench', quant: args.quant as 'none' | 'int8' | 'int4' })
  const common = { shardDir: join(dir, 'shard'), threads, maxSequences: 4, manifestHash: 'bench-manifest' }
  const holderNode = await node()
  const pullerNode = await node()
  stops.push(async () => { await pullerNode.stop(); await holderNode.stop() })
  let delayMs = 0
  let lastPull: PullOutcome | undefined
  const holder = createLocalService({ ...common, kvCacheBytes: 2 * 1024 ** 3 })
  const cold = createLocalService({ ...common, kvCacheBytes: 0 })
  let pullerService: LocalService | undefined
  const puller = createKvPuller({}, {
    openStream: async (_peer, protocol, signal) => delayed(await pullerNode.dialProtocol(holderNode.getMultiaddrs(), protocol, { signal }), delayMs, BANDWIDTH),
    store: () => pullerService?.kvStore,
  })
  pullerService = createLocalService({
    ...common,
    kvCacheBytes: 2 * 1024 ** 3,
    pullPrefix: async (a) => { lastPull = await puller.pull({ ...a, model: 'bench' }); return lastPull },
    // Measure the pull whatever the cost model says (its verdict is printed beside it).
    pullPolicy: () => true,
  })
  for (const s of [holder, cold, pullerService]) { await s.start(); stops.push(async () => { await s.stop() }) }
  const server = await serveKv({ stores: () => [holder.kvStore!] }, {
    handle: async (p, h) => { await holderNode.handle(p, h) },
    openStream: async () => { throw new Error('the holder opens nothing') },
  })
  stops.push(async () => { await server.stop() })
  const info = holder.kvStore!.info()
  const bytesPerToken = kvBytesPerToken(info)
  const vocab = manifest.shape.vocabSize
  console.log(`## ${args.size} ${args.quant}: follow-up after a ${HISTORY}-token history (+8-token reply, +${NEW} new); ${bytesPerToken} KV bytes/token; threads ${threads}; bandwidth ${BANDWIDTH === undefined ? 'uncapped' : `${BANDWIDTH} B/s`}; ${cpus().length} cores (${cpus()[0]?.model ?? '?'}); load average ${loadavg().map(x => x.toFixed(1)).join(' ')}`)
  console.log('\n| one-way delay per hop (ms) | local hit TTFT p50 (ms) | pulled TTFT p50 (ms) | recomputed TTFT p50 (ms) | moved (MB) | pull time p50 (ms) | link (MB/s) | shouldPull (measured rates) | tokens identical |')
  console.log('|---|---|---|---|---|---|---|---|---|')
  // A mesh keeps its connections up: dial once, and warm every path (JIT, sessions) with one untimed round.
  await pullerNode.dial(holderNode.getMultiaddrs())
  {
    const warm = tokens(Math.min(HISTORY, 256), 7, vocab)
    await turn(holder, warm, 2)
    await turn(pullerService, [...warm, ...tokens(8, 8, vocab)], 2, { peerId: holderNode.peerId.toString(), cachedTokens: warm.length })
    await turn(cold, warm, 2)
    // The puller knows its own prefill speed (it bounds how long a pull may take).
    await turn(pullerService, tokens(Math.min(HISTORY, 512), 9, vocab), 2)
  }
  let seed = 0
  for (const d of DELAYS) {
    delayMs = d
    const hit: number[] = []
    const pulled: number[] = []
    const recomputed: number[] = []
    const pullMs: number[] = []
    let moved = 0
    let same = 0
    let verdict = ''
    for (let r = 0; r < ROUNDS; r++) {
      seed++
      const history = tokens(HISTORY, 100 + seed, vocab)
      const first = await turn(holder, history, 8)
      const follow = [...history, ...first.tokens, ...tokens(NEW, 900 + seed, vocab)]
      // Pulled first, while the holder keeps exactly the history (its hit would supersede it).
      lastPull = undefined
      const p = await turn(pullerService, follow, 8, { peerId: holderNode.peerId.toString(), cachedTokens: HISTORY })
      if (lastPull === undefined || !(lastPull as PullOutcome).ok || p.prefix !== 'moved') throw new Error(`round ${r}: the pull did not happen: ${JSON.stringify(lastPull)}`)
      const ok = lastPull as Extract<PullOutcome, { ok: true }>
      const h = await turn(holder, follow, 8)
      const c = await turn(cold, follow, 8)
      if (JSON.stringify(p.tokens) === JSON.stringify(c.tokens) && JSON.stringify(h.tokens) === JSON.stringify(c.tokens)) same++
      hit.push(h.ttftMs)
      pulled.push(p.ttftMs)
      recomputed.push(c.ttftMs)
      pullMs.push(ok.ms)
      moved = ok.bytes
      const rates = { tokens: ok.tokens, bytesPerToken, linkBytesPerSecond: ok.bytes / (ok.ms - 2 * d) * 1000, rttMs: 2 * d, prefillTokensPerSecond: follow.length / c.ttftMs * 1000 }
      const cost = pullCost(rates)
      verdict = `${shouldPull(rates) ? 'pull' : 'recompute'} (${cost.transferMs.toFixed(0)} vs ${cost.recomputeMs.toFixed(0)} ms)`
    }
    const link = moved / 1e6 / ((median(pullMs) - 2 * d) / 1000)
    console.log(`| ${d} | ${median(hit).toFixed(0)} | ${median(pulled).toFixed(0)} | ${median(recomputed).toFixed(0)} | ${(moved / 1e6).toFixed(1)} | ${median(pullMs).toFixed(0)} | ${link.toFixed(0)} | ${verdict} | ${same}/${ROUNDS} |`)
  }
} finally {
  for (const stop of stops.reverse()) await stop().catch(() => {})
  await rm(dir, { recursive: true, force: true })
}
