/**
 * Resident MoE experts served by real daemons on loopback: a generated Mixtral checkpoint
 * compiled to expert-parallel shards; a stage node (`shoal node --model EXPERT-SHARDS --api`)
 * runs attention and the router, three holder nodes (`--hold-experts DIR --expert-memory-mb`,
 * each with room for three quarters of the experts) hold the experts, placed by the stage from
 * the memory they gossip. Through the real `openai` client against the stage: greedy tokens equal
 * the whole model's (`shoal serve` on the one-graph shards of the same checkpoint) token for
 * token, alone and as 4 concurrent streams; the plan is in /v1/mesh; a holder killed mid-stream
 * is taken over by the experts' other copies without a token changing; when the survivors cannot
 * hold the model, a stream ends with a typed OpenAI-shaped error and the next request is a 503.
 * A node with an API and no model routes the model to the stage. Every holder that ran experts for
 * a request signs a receipt part (the rows of that request it received and returned, the experts
 * it ran per layer), and the stage's receipt carries them: `shoal receipts verify --ca` accepts
 * the log, a tampered holder part is refused.
 */
import { cp, mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Level } from 'level'
import OpenAI from 'openai'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createThrowawayCa } from '../../certs/index.ts'
import { openExpertShards } from '../../daemon/experts/index.ts'
import { publicKeyFromPeerId, receiptsLocation, verifyReceiptPart, type SignedReceipt } from '../../daemon/ledger/index.ts'
import { acceptedParts } from '../../daemon/node/receipt-part.ts'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import { receiptsVerify } from '../../scripts/commands/receipts.ts'
import { renderStatus } from '../../scripts/commands/status.ts'
import type { Daemon, DaemonConfig } from '../../daemon/node/index.ts'
import { compileExpertShards, compileShards, generateTestModel } from '../../shards/index.ts'

const MODEL = 'moe-e2e'
const LISTEN = ['/ip4/127.0.0.1/tcp/0']
const N = 24
const PROMPTS = [[5, 17, 99, 230, 41, 7], [12, 9, 301], [77, 78, 79, 80, 81, 82, 83, 84, 85], [3]]
const logger = pino({ level: 'silent' })

interface MeshView { experts?: { plans: Array<{ layers: Array<{ layer: number, holders: Record<string, number[]> }>, nodes: Array<{ peerId: string, experts: number }>, excluded: string[] }> } }

const client = (url: string): OpenAI => new OpenAI({ baseURL: `${url}/v1`, apiKey: 'x', maxRetries: 0, timeout: 60_000 })

async function greedy (url: string, prompt: number[]): Promise<number[]> {
  const r = await client(url).completions.create({
    model: MODEL, prompt, max_tokens: N, temperature: 0,
    // @ts-expect-error vLLM-style extension
    return_token_ids: true,
  })
  return (r.choices[0] as unknown as { token_ids: number[] }).token_ids
}

/** A streamed greedy completion; `onToken(i)` runs after the i-th chunk with tokens. */
async function streamed (url: string, prompt: number[], onToken?: (i: number) => void): Promise<number[]> {
  // return_token_ids: the vLLM-style extension (not in the client's types).
  const body = { model: MODEL, prompt, max_tokens: N, temperature: 0, stream: true as const, return_token_ids: true }
  const stream = await client(url).completions.create(body)
  const ids: number[] = []
  let i = 0
  for await (const chunk of stream) {
    const t = (chunk.choices[0] as unknown as { token_ids?: number[] } | undefined)?.token_ids ?? []
    if (t.length === 0) continue
    ids.push(...t)
    onToken?.(i++)
  }
  return ids
}

async function meshView (url: string): Promise<MeshView> {
  return await (await fetch(`${url}/v1/mesh`)).json() as MeshView
}

/** Kills a daemon the hard way: its connections reset, then it stops. */
function kill (d: Daemon): void {
  for (const c of d.mesh!.libp2p.getConnections()) c.abort(new Error('killed by test'))
  void d.stop().catch(() => {})
}

describe('MoE experts on holder daemons', () => {
  let root: string
  const daemons: Daemon[] = []
  const holders: Array<{ daemon: Daemon, peerId: string }> = []
  let stageUrl = ''
  let stagePeerId = ''
  let ingressUrl = ''
  let soloUrl = ''
  let want: number[][] = []

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-experts-daemon-'))
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: 'mixtral', outDir: ckpt, seed: 4, modelId: MODEL })
    await compileShards({ modelDir: ckpt, outDir: join(root, 'whole') })
    const experts = join(root, 'experts')
    await compileExpertShards({ modelDir: ckpt, outDir: experts })
    const shards = await openExpertShards(experts)
    // Room for three quarters of the experts each: every expert fits twice over the three holders
    // (so each has a second copy), never on one holder alone.
    const memoryMb = 0.75 * shards.experts * shards.expertBytes / (1024 * 1024)
    const ca = await createThrowawayCa(join(root, 'ca'), ['stage', 'h1', 'h2', 'h3', 'ingress'])
    const base = { device: 'cpu', cacheRoot: join(root, 'cache'), listen: LISTEN, mdns: false }
    const start = async (config: DaemonConfig): Promise<{ daemon: Daemon, apiUrl?: string }> => {
      const daemon = createDaemon(validateConfig(config), { logger })
      daemons.push(daemon)
      return { daemon, ...(await daemon.start()) }
    }
    const [is, ih1, ih2, ih3, ii] = ca.identities
    const ih = [ih1!, ih2!, ih3!]
    const stage = await start({ ...base, identityDir: is!.dir, models: [{ dir: experts }], api: { host: '127.0.0.1', port: 0 }, dataDir: join(root, 'data-stage'), bootstrap: [] })
    stageUrl = stage.apiUrl!
    stagePeerId = is!.peerId
    const boot = stage.daemon.mesh!.libp2p.getMultiaddrs().map(x => x.toString())
    for (const [i, id] of ih.entries()) {
      const h = await start({ ...base, identityDir: id.dir, models: [], holdExperts: { dir: experts, memoryMb }, dataDir: join(root, `data-h${i}`), bootstrap: boot })
      holders.push({ daemon: h.daemon, peerId: id.peerId })
    }
    // A node with an API and no model: it routes the model to the stage like any whole model.
    ingressUrl = (await start({ ...base, identityDir: ii!.dir, models: [], api: { host: '127.0.0.1', port: 0 }, dataDir: join(root, 'data-ingress'), bootstrap: boot })).apiUrl!
    const solo = await start({ ...base, listen: [], bootstrap: [], models: [{ dir: join(root, 'whole') }], api: { host: '127.0.0.1', port: 0 }, dataDir: join(root, 'data-solo') })
    soloUrl = solo.apiUrl!
    want = []
    for (const p of PROMPTS) want.push(await greedy(soloUrl, p))
    // The stage plans once it has heard all three holders' capabilities.
    const deadline = Date.now() + 30_000
    while (Date.now() < deadline) {
      const plan = (await meshView(stageUrl)).experts?.plans[0]
      if (plan !== undefined && plan.nodes.length === 3) break
      await new Promise(resolve => setTimeout(resolve, 200))
    }
  }, 240_000)

  afterAll(async () => {
    for (const d of daemons.reverse()) await d.stop().catch(() => {})
    await rm(root, { recursive: true, force: true })
  })

  it('places every expert on two of the three holders and shows the plan in /v1/mesh', async () => {
    const plan = (await meshView(stageUrl)).experts!.plans[0]!
    expect(plan.nodes.map(n => n.peerId).sort()).toEqual(holders.map(h => h.peerId).sort())
    for (const l of plan.layers) {
      const copies = new Array<number>(8).fill(0)
      for (const experts of Object.values(l.holders)) for (const e of experts) copies[e]!++
      expect(copies).toEqual(new Array<number>(8).fill(2))
    }
    // No holder holds everything: the model is spread.
    for (const n of plan.nodes) expect(n.experts).toBeLessThan(8 * plan.layers.length)
    // `shoal status` shows it compactly: a row per holder with its expert count per MoE layer.
    const lines = renderStatus(await meshView(stageUrl) as Parameters<typeof renderStatus>[0]).split('\n')
    const at = lines.findIndex(l => l.startsWith(`experts of ${MODEL}`))
    expect(lines[at]).toMatch(/: 3 holders, \d+ MoE layers/)
    for (const h of holders) expect(lines.some(l => l.includes(h.peerId) && /\s\d+$/.test(l))).toBe(true)
    expect(lines[at + 5]).toMatch(/^\s+\(min copies\)(\s+2)+$/)
    // The dashboard's state: the same plan, holders × expert counts per layer.
    const dash = await (await fetch(`${stageUrl}/dashboard/state`)).json() as { experts: { plans: Array<{ model: string, layers: number[], holders: Array<{ peerId: string, counts: number[] }>, minCopies: number[] }> } }
    const dp = dash.experts.plans[0]!
    expect(dp.model).toBe(MODEL)
    expect(dp.holders.map(h => h.peerId).sort()).toEqual(holders.map(h => h.peerId).sort())
    for (const h of dp.holders) expect(h.counts).toEqual(plan.layers.map(l => l.holders[h.peerId]?.length ?? 0))
    expect(dp.minCopies).toEqual(plan.layers.map(() => 2))
  })

  it('gives the whole model\'s greedy tokens, alone and as 4 concurrent streams', async () => {
    expect(new Set(want[0]).size).toBeGreaterThan(4)
    expect(await greedy(stageUrl, PROMPTS[0]!)).toEqual(want[0])
    const together = await Promise.all(PROMPTS.map(async p => await streamed(stageUrl, p)))
    expect(together).toEqual(want)
    // Through another node's API: routed to the stage, same tokens.
    const until = Date.now() + 30_000
    while (Date.now() < until) {
      const ids = ((await (await fetch(`${ingressUrl}/v1/models`)).json()) as { data: Array<{ id: string }> }).data.map(m => m.id)
      if (ids.includes(MODEL)) break
      await new Promise(resolve => setTimeout(resolve, 200))
    }
    expect(await greedy(ingressUrl, PROMPTS[1]!)).toEqual(want[1])
    // Every holder computed experts, and keeps resident only what it was given.
    for (const h of holders) {
      const held = (await meshView(stageUrl)).experts!.plans[0]!.nodes.find(n => n.peerId === h.peerId)!
      expect(held.experts).toBeGreaterThan(0)
    }
  }, 120_000)

  it('every holder that ran experts for a request signs a part; the receipt carries them and the log verifies', async () => {
    // Two requests at once: their rows share expert steps, each holder's part counts only its own request's rows.
    const ask = async (prompt: number[]): Promise<{ ids: number[], receipt: string, usage: { prompt_tokens: number, completion_tokens: number } }> => {
      const res = await fetch(`${stageUrl}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: MODEL, prompt, max_tokens: N, temperature: 0, return_token_ids: true }) })
      const body = await res.json() as { choices: Array<{ token_ids: number[] }>, usage: { prompt_tokens: number, completion_tokens: number } }
      return { ids: body.choices[0]!.token_ids, receipt: res.headers.get('x-shoal-receipt')!, usage: body.usage }
    }
    const done = await Promise.all([ask(PROMPTS[2]!), ask(PROMPTS[3]!)])
    expect(done.map(d => d.ids)).toEqual([want[2], want[3]])
    const holderIds = holders.map(h => h.peerId)
    const moeLayers = (await openExpertShards(join(root, 'experts'))).layout.shape.moe!.moeLayers
    for (const d of done) {
      const { body } = await (await fetch(`${stageUrl}/v1/receipts/${d.receipt}`)).json() as { body: SignedReceipt['body'] }
      const parts = body.parts.filter(p => holderIds.includes(p.body.peerId))
      expect(parts.length).toBeGreaterThan(0)
      let rowsIn = 0
      for (const p of parts) {
        expect(verifyReceiptPart(p, publicKeyFromPeerId(p.body.peerId)!)).toBe(true)
        expect(p.body).toMatchObject({ requestId: d.receipt, model: MODEL })
        expect(p.body.experts!.map(e => e.layer).every(l => moeLayers.includes(l))).toBe(true)
        expect(p.body.tokens.output).toBe(p.body.tokens.input)
        rowsIn += p.body.tokens.input
      }
      // This request's rows (prompt, then every generated token but the last fed back) went to
      // its top-2 experts at every MoE layer: at least once and at most twice per row and layer
      // over all holders — never another request's rows.
      const rows = d.usage.prompt_tokens + d.usage.completion_tokens - 1
      expect(rowsIn).toBeGreaterThanOrEqual(rows * moeLayers.length)
      expect(rowsIn).toBeLessThanOrEqual(rows * moeLayers.length * 2)
      // A holder part with its share changed is refused (the ingress leaves it out of a receipt).
      const forged = { ...parts[0]!, body: { ...parts[0]!.body, tokens: { input: 1, output: 1 } } }
      expect(acceptedParts([forged, parts[0]!], d.receipt)).toMatchObject({ rejected: 1, accepted: [parts[0]] })
    }
    // Through another node's API (routed to the stage): the ingress's receipt carries the stage's
    // part and the holders' parts the stage handed up with its end.
    const routed = await fetch(`${ingressUrl}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: MODEL, prompt: PROMPTS[1], max_tokens: 4, temperature: 0 }) })
    expect(routed.status).toBe(200)
    const viaIngress = await (await fetch(`${ingressUrl}/v1/receipts/${routed.headers.get('x-shoal-receipt')!}`)).json() as { body: SignedReceipt['body'] }
    const signers = viaIngress.body.parts.map(p => p.body.peerId)
    expect(signers).toContain(stagePeerId)
    expect(signers.filter(p => holderIds.includes(p)).length).toBeGreaterThan(0)
    expect(viaIngress.body.parts.filter(p => p.body.experts !== undefined).every(p => holderIds.includes(p.body.peerId))).toBe(true)
    const ingressReport = await receiptsVerify({ data: join(root, 'data-ingress'), ca: join(root, 'ca', 'ca', 'ca.cert.json') }, () => {})
    expect(ingressReport.ok).toBe(true)
    // `shoal receipts verify --ca` on the stage's (running) log: every signer, holders included, chains to the CA.
    const lines: string[] = []
    const report = await receiptsVerify({ data: join(root, 'data-stage'), ca: join(root, 'ca', 'ca', 'ca.cert.json') }, line => { lines.push(line) })
    expect(report.ok).toBe(true)
    expect(holderIds.filter(h => report.partSigners.includes(h)).length).toBeGreaterThan(0)
    expect(lines.at(-1)).toMatch(/^ca: every signer and \d+ part signers .* chains to CA/)
    // The same log with one holder part's share rewritten no longer verifies, at that entry.
    const copy = join(root, 'data-stage-tampered')
    await cp(join(root, 'data-stage'), copy, { recursive: true })
    const db = new Level<string, string>(receiptsLocation(copy), { valueEncoding: 'utf8' })
    await db.open()
    let tampered = -1
    for await (const [key, value] of db.iterator({ gte: 'e/', lt: 'e0' })) {
      const entry = JSON.parse(value) as SignedReceipt
      const part = entry.body.parts.find(p => p.body.experts !== undefined)
      if (part === undefined) continue
      part.body.experts![0]!.experts = [...part.body.experts![0]!.experts, 7].filter((e, i, a) => a.indexOf(e) === i).sort((a, b) => a - b)
      part.body.tokens = { input: part.body.tokens.input + 1, output: part.body.tokens.output + 1 }
      await db.put(key, JSON.stringify(entry))
      tampered = entry.body.index
      break
    }
    await db.close()
    expect(tampered).toBeGreaterThanOrEqual(0)
    // (The stage's signature covers its parts: the first check to fail is the entry's own.)
    await expect(receiptsVerify({ data: copy }, () => {})).rejects.toThrow(new RegExp(`^receipts: entry ${tampered} \\(id [^)]+\\): bad-(signature|part)`))
  }, 120_000)

  it('a holder killed mid-stream: the experts\' other copies take over and no token changes', async () => {
    const victim = holders[2]!
    const got = await streamed(stageUrl, PROMPTS[0]!, (i) => { if (i === 5) kill(victim.daemon) })
    expect(got).toEqual(want[0])
    // Then the stage plans over the two survivors (three quarters each: still every expert once).
    const again = await Promise.all(PROMPTS.slice(0, 2).map(async p => await streamed(stageUrl, p)))
    expect(again).toEqual(want.slice(0, 2))
    const plan = (await meshView(stageUrl)).experts!.plans[0]!
    expect(plan.layers.every(l => !(victim.peerId in l.holders))).toBe(true)
  }, 120_000)

  it('when the survivors cannot hold the model: the stream ends with a typed error, then requests get a 503', async () => {
    const started = Date.now()
    const err = await streamed(stageUrl, PROMPTS[0]!, (i) => { if (i === 3) kill(holders[1]!.daemon) }).then(() => undefined, (e: unknown) => e)
    expect(err).toBeInstanceOf(OpenAI.APIError)
    expect(String((err as Error).message)).toMatch(/expert/)
    expect((err as { code?: unknown }).code).toBe('SHOAL_ERR_EXPERTS_UNPLACEABLE')
    expect(Date.now() - started).toBeLessThan(30_000)
    // One holder with room for three quarters of the experts: no plan, a clean 503 before any token.
    const res = await fetch(`${stageUrl}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: MODEL, prompt: PROMPTS[1], max_tokens: 4 }) })
    expect(res.status).toBe(503)
    const body = await res.json() as { error: { code: string, type: string } }
    expect(body.error.code).toBe('SHOAL_ERR_EXPERTS_UNPLACEABLE')
    expect(body.error.type).toBe('server_error')
  }, 120_000)
})
