/**
 * Counterexamples the fuzz suite (test/fuzz/*.fuzz.test.ts) found, pinned as plain test cases:
 * each failed before its fix (reproduction/results/fuzz.md lists them).
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { randomBytes, randomUUID } from 'node:crypto'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { peerIdFromPrivateKey } from '@libp2p/peer-id'
import { privateKeyFromRaw } from '@libp2p/crypto/keys'
import { publicKeyOf } from '../../certs/index.ts'
import { createLedger, createReceiptPart, publicKeyFromPeerId, verifyReceiptPart, type Ledger } from '../../daemon/ledger/index.ts'
import { withReceipts } from '../../daemon/node/index.ts'
import { withReceiptPart } from '../../daemon/node/receipt-part.ts'
import type { GenerateEvent, InferenceService } from '../../daemon/service.ts'
import { parseToWorker } from '../../daemon/engine/protocol.ts'
import { createIngress } from '../../daemon/ingress/index.ts'
import { validateManifest } from '../../shards/manifest.ts'
import { openWeights } from '../../shards/safetensors.ts'
import { createSimulatedService } from '../support/simulated-service.ts'

function makeKey (): { seed: Uint8Array, peerId: string } {
  const seed = new Uint8Array(randomBytes(32))
  return { seed, peerId: peerIdFromPrivateKey(privateKeyFromRaw(new Uint8Array([...seed, ...publicKeyOf(seed)]))).toString() }
}

describe('a signed receipt part with a field beside {body, signature} (signed.fuzz: "receipt part: one field changed")', () => {
  const peer = makeKey()
  const part = createReceiptPart({
    requestId: 'r-1', peerId: peer.peerId, model: 'm', layers: [0, 3], inputHash: 'ab'.repeat(32), outputHash: 'cd'.repeat(32),
    tokens: { input: 5, output: 2 }, timing: { startedAt: 1_780_315_200_000, durationMs: 12.5 },
  }, peer.seed)

  it('does not verify: the extra field is not signed', () => {
    const key = publicKeyFromPeerId(peer.peerId)!
    expect(verifyReceiptPart(part, key)).toBe(true)
    // The counterexample fast-check shrank to.
    expect(verifyReceiptPart({ ...part, '': {} }, key)).toBe(false)
    expect(verifyReceiptPart(JSON.parse(`{"__proto__":{},${JSON.stringify(part).slice(1)}`), key)).toBe(false)
  })

  describe('from a peer that adds one to its part', () => {
    let dir: string
    let ledger: Ledger
    beforeAll(async () => {
      dir = await mkdtemp(join(tmpdir(), 'shoal-pinned-'))
      const self = makeKey()
      ledger = createLedger({ dataDir: dir, signer: { peerId: self.peerId, secretKey: self.seed } })
      await ledger.start()
    })
    afterAll(async () => {
      await ledger.stop()
      await rm(dir, { recursive: true, force: true })
    })

    it('the completion is still receipted, without that part (before: the append failed after generating)', async () => {
      const honest = withReceiptPart(createSimulatedService({ models: ['sim'], script: { reply: 'xyz' } }), { peerId: peer.peerId, secretKey: peer.seed })
      const padded: InferenceService = {
        models: () => honest.models(),
        async * generate (request, signal) {
          for await (const e of honest.generate(request, signal)) {
            yield e.type === 'end' ? { ...e, receiptParts: (e.receiptParts ?? []).map(p => ({ ...(p as object), note: 'x'.repeat(1000) })) } : e
          }
        },
      }
      let rejected = 0
      const requestId = randomUUID()
      const events: GenerateEvent[] = []
      for await (const e of withReceipts(padded, ledger, { onRejectedParts: (_id, n) => { rejected += n } }).generate({
        requestId, model: 'sim', prompt: { kind: 'text', text: 'hi' }, sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 60_000,
      }, new AbortController().signal)) events.push(e)
      expect(events.at(-1)?.type).toBe('end')
      expect(rejected).toBe(1)
      const stored = await ledger.get(requestId)
      expect(stored?.receipt.body.parts).toEqual([])
      expect((await ledger.verify()).ok).toBe(true)
    })
  })
})

describe('a worker message whose type is not a string (json-wire.fuzz: "engine protocol: messages to the worker")', () => {
  it('is refused with an error text, not a TypeError out of the worker\'s message handler', () => {
    // The counterexample fast-check shrank to, and its neighbours.
    expect(parseToWorker({ type: BigInt64Array.from([1n, 2n]), id: 0 })).toBe('unknown message type of type object')
    expect(parseToWorker({ type: 5n, id: 0 })).toBe('unknown message type of type bigint')
    const cyclic: Record<string, unknown> = {}
    cyclic.self = cyclic
    expect(parseToWorker({ type: cyclic, id: 0 })).toMatch(/^unknown message type/)
    expect(parseToWorker({ type: 'nope', id: 0 })).toBe('unknown message type "nope"')
  })
})

describe('keys required: a percent-encoded path to a /v1 route (http.fuzz: "keys required: paths to the routes")', () => {
  it('still needs a key (before: /%761/completions ran a completion, /%761/mesh showed the mesh, without one)', async () => {
    const reached: string[] = []
    const ingress = createIngress({ logger: false }, {
      service: createSimulatedService({ models: [{ id: 'sim' }] }),
      auth: { check: () => ({ ok: false, detail: 'not a key' }) },
      mesh: { snapshot: () => { reached.push('mesh'); return { peers: [] } } },
      receipts: { get: async () => { reached.push('receipts'); return undefined } },
    })
    await ingress.app.ready()
    try {
      for (const [method, url] of [['GET', '/%761/models'], ['GET', '/v%31/models'], ['GET', '/%761/mesh'], ['GET', '/%76%31/receipts/x'], ['POST', '/%761/completions'], ['POST', '/v1/%63hat/completions'], ['GET', '/%761/nothing-here']] as const) {
        const res = await ingress.app.inject({ method, url, ...(method === 'POST' ? { payload: { model: 'sim', prompt: 'hi', messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 } } : {}) })
        expect(res.statusCode, url).toBe(401)
        expect(res.json().error.code).toBe('SHOAL_ERR_INVALID_API_KEY')
      }
      expect(reached).toEqual([])
      // Open routes stay open, however they are spelled.
      expect((await ingress.app.inject({ method: 'GET', url: '/%68ealthz' })).statusCode).toBe(200)
    } finally {
      await ingress.stop()
    }
  })
})

describe('a shard manifest with null where an object belongs (json-wire.fuzz: "manifest: one value replaced")', () => {
  it('is a ManifestError, not a TypeError', () => {
    const hex = (c: string): string => c.repeat(64)
    const manifest = {
      format: 'shoal-shards/1', modelId: 'm', sourceHash: hex('e'),
      shape: { hiddenSize: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, headDim: 16, intermediateSize: 128, vocabSize: 512, maxPositions: 2048 },
      quantization: { kind: 'none' }, generation: { eosTokenIds: [1] }, tokenizerFiles: [],
      stages: [{ index: 0, layers: [0, 1], hasEmbedding: true, hasHead: true, dir: 's', graph: 's/m.onnx', files: [{ path: 's/m.onnx', sha256: hex('b'), bytes: 1 }] }],
    }
    expect(validateManifest(structuredClone(manifest)).modelId).toBe('m')
    // The counterexample fast-check shrank to (stages[0] = null), and the other objects read without a check.
    for (const patch of [
      (m: any) => { m.stages[0] = null }, (m: any) => { m.quantization = null }, (m: any) => { m.shape = null },
      (m: any) => { m.generation = null }, (m: any) => { m.shape.moe = null }, (m: any) => { m.static = null },
    ]) {
      const m = structuredClone(manifest)
      patch(m)
      expect(() => validateManifest(m)).toThrow(expect.objectContaining({ name: 'ManifestError', code: 'SHOAL_ERR_MANIFEST' }))
    }
  })
})

describe('a safetensors header whose offsets claim more than the file holds (json-wire.fuzz: "checkpoint: safetensors header and data")', () => {
  let dir: string
  beforeAll(async () => { dir = await mkdtemp(join(tmpdir(), 'shoal-pinned-ckpt-')) })
  afterAll(async () => { await rm(dir, { recursive: true, force: true }) })

  it('is a CheckpointError when the checkpoint is opened, before anything that size is allocated', async () => {
    // The counterexamples fast-check shrank to: a 22 GiB range in a file of 8 + 41 bytes (before:
    // Buffer.alloc's RangeError at get — a smaller claim was allocated), and an entry without a shape.
    for (const header of ['{"":{"data_offsets":[0,23622320128]}}', '{"":{"dtype":"F32","data_offsets":[0,0]}}', '{"w":{"dtype":"F32","shape":[1000000],"data_offsets":[0,4000000]}}', '[]']) {
      const d = await mkdtemp(join(dir, 'c'))
      const h = Buffer.from(header)
      const bytes = Buffer.alloc(8 + h.length)
      bytes.writeBigUInt64LE(BigInt(h.length), 0)
      h.copy(bytes, 8)
      await writeFile(join(d, 'model.safetensors'), bytes)
      await expect(openWeights(d), header).rejects.toMatchObject({ name: 'CheckpointError', code: 'SHOAL_ERR_CHECKPOINT' })
    }
    const index = await mkdtemp(join(dir, 'i'))
    await writeFile(join(index, 'model.safetensors.index.json'), '{"weight_map":{"a":7}}')
    await expect(openWeights(index)).rejects.toMatchObject({ name: 'CheckpointError' })
    await writeFile(join(index, 'model.safetensors.index.json'), '{nope')
    await expect(openWeights(index)).rejects.toMatchObject({ name: 'CheckpointError' })
  })
})
