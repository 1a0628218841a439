/**
 * A pipeline-sharded model served by real daemons on loopback: node A holds stage 0 (and
 * coordinates), node B holds stage 1, node C has an API and no model. A request to C is routed to
 * A, runs the chain A → B, and gives exactly the greedy tokens of the unsplit model served by
 * `shoal serve` (a one-machine daemon) — over a whole 64-token completion.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import OpenAI from 'openai'
import { pino } from 'pino'
import { createThrowawayCa } from '../../certs/index.ts'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { Daemon, DaemonConfig } from '../../daemon/node/index.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import { receiptsVerify } from '../../scripts/commands/receipts.ts'

const LISTEN = ['/ip4/127.0.0.1/tcp/0']
const logger = pino({ level: 'silent' })

async function completionIds (baseURL: string, prompt: number[]): Promise<{ ids: number[], route: string | null, receipt: string | null }> {
  const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'x', maxRetries: 0 })
  const { data, response } = await client.completions.create({
    model: 'chain-demo', prompt, max_tokens: 64, temperature: 0,
    // @ts-expect-error vLLM-style extension
    return_token_ids: true,
  }).withResponse()
  return { ids: (data.choices[0] as unknown as { token_ids: number[] }).token_ids, route: response.headers.get('x-shoal-route'), receipt: response.headers.get('x-shoal-receipt') }
}

describe('pipeline chain through daemons', () => {
  let root: string
  const daemons: Daemon[] = []
  let urlC = ''
  let urlSolo = ''
  let peers: string[] = []
  let nodeC: Daemon | undefined

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-chain-daemon-'))
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: 'llama', outDir: ckpt, size: 'tiny', seed: 4 })
    await compileShards({ modelDir: ckpt, outDir: join(root, 'whole'), modelId: 'chain-demo' })
    const manifest = await compileShards({ modelDir: ckpt, outDir: join(root, 'two'), modelId: 'chain-demo', stages: 2 })
    const [s0, s1] = manifest.stages.map(s => s.layers)
    const ca = await createThrowawayCa(join(root, 'ca'), ['a', 'b', 'c'])
    const base = { device: 'cpu', cacheRoot: join(root, 'cache'), listen: LISTEN, mdns: false }
    const start = async (config: DaemonConfig): Promise<{ daemon: Daemon, apiUrl?: string }> => {
      const daemon = createDaemon(validateConfig(config), { logger })
      daemons.push(daemon)
      return { daemon, ...(await daemon.start()) }
    }
    const [ia, ib, ic] = ca.identities
    const a = await start({ ...base, identityDir: ia!.dir, models: [{ dir: join(root, 'two'), layers: s0! }], api: { host: '127.0.0.1', port: 0 }, dataDir: join(root, 'data-a'), bootstrap: [] })
    const boot = a.daemon.mesh!.libp2p.getMultiaddrs().map(x => x.toString())
    await start({ ...base, identityDir: ib!.dir, models: [{ dir: join(root, 'two'), layers: s1! }], dataDir: join(root, 'data-b'), bootstrap: boot })
    const c = await start({ ...base, identityDir: ic!.dir, models: [], api: { host: '127.0.0.1', port: 0 }, dataDir: join(root, 'data-c'), bootstrap: boot })
    nodeC = c.daemon
    peers = [ia!.peerId, ib!.peerId]
    urlC = c.apiUrl!
    const solo = createDaemon(validateConfig({ ...base, listen: [], bootstrap: [], models: [{ dir: join(root, 'whole') }], api: { host: '127.0.0.1', port: 0 }, dataDir: join(root, 'data-solo') }), { logger })
    daemons.push(solo)
    urlSolo = (await solo.start()).apiUrl!
  }, 180_000)

  afterAll(async () => {
    for (const d of daemons.reverse()) await d.stop().catch(() => {})
    await rm(root, { recursive: true, force: true })
  })

  it('lists the chained model on a node that holds none of it, once the chain is complete', async () => {
    expect(urlC).not.toBe('')
    const deadline = Date.now() + 30_000
    let ids: string[] = []
    while (Date.now() < deadline) {
      const res = await fetch(`${urlC}/v1/models`)
      ids = ((await res.json()) as { data: Array<{ id: string }> }).data.map(m => m.id)
      if (ids.includes('chain-demo')) break
      await new Promise(resolve => setTimeout(resolve, 250))
    }
    expect(ids).toContain('chain-demo')
  })

  it('gives the unsplit model\'s greedy tokens over a whole 64-token completion, routed through the chain', async () => {
    const prompt = [5, 17, 99, 230, 41, 7]
    const solo = await completionIds(urlSolo, prompt)
    const chained = await completionIds(urlC, prompt)
    expect(solo.ids.length).toBeGreaterThan(0)
    expect(chained.ids).toEqual(solo.ids)
    expect(chained.route?.split(',')).toEqual(peers)

    // The ingress's receipt names each stage with its layers and the exact shard build.
    const res = await fetch(`${urlC}/v1/receipts/${chained.receipt}`)
    const receipt = await res.json() as { body: { route: Array<{ peerId: string, layers?: number[] }>, model: { manifestHash: string | null } }, certificate: { body: { peerId: string } } }
    // A mesh node's receipt comes with its CA-issued certificate.
    expect(receipt.certificate.body.peerId).toBeDefined()
    expect(receipt.body.route.map(h => h.peerId)).toEqual(peers)
    expect(receipt.body.route.every(h => Array.isArray(h.layers))).toBe(true)
    expect(receipt.body.model.manifestHash).toMatch(/^[0-9a-f]{64}$/)
    // Stage 1 signed its own share (layers, hashes of the activations it took and the tokens it
    // gave back), and the coordinator's executor part came back through the forwarding hop.
    const parts = (receipt.body as unknown as { parts: Array<{ body: { peerId: string, layers: number[] | null, tokens: { input: number, output: number } } }> }).parts
    const stagePart = parts.find(p => p.body.peerId === peers[1])
    expect(stagePart?.body.layers).toEqual(receipt.body.route[1]!.layers)
    expect(stagePart?.body.tokens.output).toBe(chained.ids.length)
    expect(parts.some(p => p.body.peerId === peers[0])).toBe(true)
  })
  it('leaves a log on the ingress that `shoal receipts verify --ca` accepts: every signer, stages included, certified by the CA', async () => {
    // The log is a level database: the node must be stopped before the CLI opens it.
    await nodeC!.stop()
    const lines: string[] = []
    const report = await receiptsVerify({ data: join(root, 'data-c'), ca: join(root, 'ca', 'ca', 'ca.cert.json') }, line => { lines.push(line) })
    expect(report.entries).toBeGreaterThanOrEqual(1)
    expect([...report.partSigners].sort()).toEqual([...peers].sort())
    expect(lines.at(-1)).toMatch(/^ca: every signer and 2 part signers .* chains to CA "shoal-throwaway-ca"/)
  })
})
