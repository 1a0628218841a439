/**
 * Fuzz of the JSON decoders: the mesh's /shoal/admit and /shoal/load frames and its gossip envelopes
 * (WireError, SHOAL_ERR_MESH_*), /shoal/heads frames (round trip; hostile bytes are in
 * test/certs/decoders.fuzz.test.ts), what a node reads back from its own disk (receipt-log head and
 * entries, witnessed-heads file, key and document files) and from the command line (--api,
 * --model), and the engine worker's message check. Each returns a value or its typed refusal.
 */
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import fc from 'fast-check'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { readCaCertificateFile } from '../../certs/index.ts'
import { readJsonFile, readPrivateKeyFile } from '../../certs/files.ts'
import { parseToWorker } from '../../daemon/engine/protocol.ts'
import { createLogHead, headsFromFile, parseLogHead } from '../../daemon/ledger/index.ts'
import { parseEntry, parseEntryKey, parseHead } from '../../daemon/ledger/store.ts'
import { decodeAdmitFrame, encodeAdmitFrame, helloFrame, refusedFrame, ADMIT_MAX_FRAME } from '../../daemon/mesh/wire/admit.ts'
import { decodeCapsMessage, CAPS_MAX_MESSAGE } from '../../daemon/mesh/wire/caps.ts'
import { errorFrame } from '../../daemon/mesh/wire/frame.ts'
import { decodeLoadFrame, encodeLoadFrame, LOAD_MAX_FRAME } from '../../daemon/mesh/wire/load.ts'
import type { LoadFrame } from '../../daemon/mesh/wire/load.ts'
import { decodeRevocationsMessage, REVOCATIONS_MAX_MESSAGE } from '../../daemon/mesh/wire/revocations.ts'
import { WIRE_ERROR_CODES } from '../../daemon/mesh/errors.ts'
import { parseApiAddress, parseModelEntry } from '../../daemon/node/config.ts'
import { validateManifest } from '../../shards/manifest.ts'
import { openWeights, writeSafetensors } from '../../shards/safetensors.ts'
import { decodeHeadFrame, encodeHeadFrame } from '../../daemon/witness/index.ts'
import { makeSigner } from '../ledger/fixtures/keys.ts'
import { anyBytes, anyJson, expectTyped, expectTypedAsync, near, reportRuns, runs } from './fuzz.ts'

reportRuns(import.meta.filename)

const MESH = { name: 'WireError', code: 'SHOAL_ERR_MESH_' }
const utf8 = new TextEncoder()
const json = (v: unknown): Uint8Array => utf8.encode(JSON.stringify(v))

const finite = fc.double({ min: 0, noNaN: true, noDefaultInfinity: true }).map(x => x === 0 ? 0 : x)
const loadFrame: fc.Arbitrary<LoadFrame> = fc.oneof(
  fc.nat({ max: 0xffffffff }).map(id => ({ v: 1 as const, type: 'req' as const, id })),
  fc.record({
    id: fc.nat({ max: 0xffffffff }),
    load: fc.record({
      queueDepth: finite, inFlight: finite, decodeTokPerSec: finite, freeKvTokens: finite, expectedWaitMs: finite,
      slots: finite, accepting: fc.boolean(), fromYou: finite,
      prefixes: fc.array(fc.stringMatching(/^[0-9a-f]{16}$/), { maxLength: 64 }),
    }, { requiredKeys: ['queueDepth', 'inFlight', 'decodeTokPerSec', 'freeKvTokens', 'expectedWaitMs'] }),
  }).map(r => ({ v: 1 as const, type: 'load' as const, ...r })),
  fc.tuple(fc.constantFrom(...WIRE_ERROR_CODES), fc.string({ maxLength: 512 }), fc.option(fc.nat({ max: 0xffffffff }), { nil: undefined }))
    .map(([code, message, id]) => errorFrame(code, message, id)),
)
const doc = fc.dictionary(fc.string({ maxLength: 8 }), fc.jsonValue({ maxDepth: 2 })).map(v => JSON.parse(JSON.stringify(v)) as Record<string, unknown>)
const admitFrame = fc.oneof(
  fc.tuple(doc, fc.option(doc, { nil: undefined })).map(([c, r]) => helloFrame(c, r)),
  fc.constant({ v: 1 as const, type: 'accept' as const }),
  fc.tuple(fc.string({ maxLength: 64 }), fc.string({ maxLength: 512 })).map(([reason, detail]) => refusedFrame(reason, detail)),
  fc.tuple(fc.constantFrom(...WIRE_ERROR_CODES), fc.string({ maxLength: 100 })).map(([code, message]) => errorFrame(code, message)),
)

/** Bytes a peer could send that reach the per-type decoders: envelopes with the right v and type, and anything in them. */
const envelope = (types: string[]): fc.Arbitrary<Uint8Array> => fc.tuple(fc.constantFrom(...types), fc.dictionary(fc.string({ maxLength: 12 }), anyJson, { maxKeys: 5 }), fc.dictionary(fc.constantFrom('id', 'load', 'certificate', 'revocations', 'reason', 'detail', 'code', 'message', 'record', 'list'), anyJson))
  .map(([type, extra, known]) => json({ ...extra, ...known, v: 1, type }))

describe('mesh frames', () => {
  const decoders = [
    { name: 'admit', decode: decodeAdmitFrame, cap: ADMIT_MAX_FRAME, types: ['hello', 'accept', 'refused', 'error'] },
    { name: 'load', decode: decodeLoadFrame, cap: LOAD_MAX_FRAME, types: ['req', 'load', 'error'] },
    { name: 'caps', decode: decodeCapsMessage, cap: CAPS_MAX_MESSAGE, types: ['caps'] },
    { name: 'revocations', decode: decodeRevocationsMessage, cap: REVOCATIONS_MAX_MESSAGE, types: ['revocations'] },
  ]

  it('valid load and admit frames round-trip', () => {
    fc.assert(fc.property(loadFrame, (f) => { expect(decodeLoadFrame(encodeLoadFrame(f))).toEqual(f) }), runs('load: round trip', 200))
    fc.assert(fc.property(admitFrame, (f) => { expect(decodeAdmitFrame(encodeAdmitFrame(f))).toEqual(f) }), runs('admit: round trip', 200))
  })

  for (const d of decoders) {
    it(`${d.name}: arbitrary bytes, envelopes with arbitrary contents and bytes near valid frames decode or throw WireError`, () => {
      const typed = (b: Uint8Array): void => { expectTyped(() => d.decode(b), MESH, b) }
      fc.assert(fc.property(anyBytes, typed), runs(`${d.name}: arbitrary bytes`, 300))
      fc.assert(fc.property(envelope(d.types), typed), runs(`${d.name}: envelopes with arbitrary fields`, 300))
      if (d.name === 'load') fc.assert(fc.property(loadFrame.chain(f => near(encodeLoadFrame(f))), typed), runs('load: near a valid frame', 300))
      if (d.name === 'admit') fc.assert(fc.property(admitFrame.chain(f => near(encodeAdmitFrame(f))), typed), runs('admit: near a valid frame', 300))
      // Over the cap: refused from its length, before it is decoded.
      expect(() => d.decode(new Uint8Array(d.cap + 1).fill(0x20))).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_MESH_TOO_LARGE' }))
    })
  }
})

describe('log head frames', () => {
  it('any valid signed head round-trips', () => {
    const s = makeSigner()
    fc.assert(fc.property(fc.nat({ max: 2 ** 40 }), fc.stringMatching(/^[0-9a-f]{64}$/), fc.maxSafeNat(), (count, hash, timestamp) => {
      const head = createLogHead({ signer: s.peerId, count, hash: count === 0 ? '0'.repeat(64) : hash, timestamp }, s.secretKey)
      fc.pre(parseLogHead(head).ok)
      expect(decodeHeadFrame(encodeHeadFrame(head))).toEqual(head)
    }), runs('log head: round trip', 100))
  })
})

describe('what a node reads back from its own disk', () => {
  it('the receipt log\'s head pointer, entries and keys parse to a value or undefined, never throw', () => {
    const text = fc.oneof(fc.string({ unit: 'binary', maxLength: 64 }), fc.json({ maxDepth: 3 }), anyJson.map(v => JSON.stringify(v) ?? ''),
      fc.record({ index: anyJson, hash: anyJson, id: anyJson }, { requiredKeys: [] }).map(v => JSON.stringify(v)))
    fc.assert(fc.property(text, (t) => {
      const h = parseHead(t)
      if (h !== undefined) expect(typeof h.index === 'number' && typeof h.hash === 'string' && typeof h.id === 'string').toBe(true)
      const e = parseEntry(t)
      if (e !== undefined) expect(typeof e === 'object' && e !== null).toBe(true)
      const k = parseEntryKey(t)
      if (k !== undefined) expect(Number.isSafeInteger(k) && k >= 0).toBe(true)
      expect(parseHead(undefined)).toBeUndefined()
    }), runs('ledger store: head, entry, key text', 300))
  })

  it('a witnessed-heads file of any content yields well-formed heads and a count of the rest', () => {
    const s = makeSigner()
    const head = JSON.parse(JSON.stringify(createLogHead({ signer: s.peerId, count: 1, hash: 'ab'.repeat(32), timestamp: 1 }, s.secretKey))) as unknown
    const file = fc.oneof(anyJson, fc.array(fc.oneof(anyJson, fc.constant(head)), { maxLength: 4 }),
      fc.dictionary(fc.string({ maxLength: 8 }), fc.oneof(anyJson, fc.constant(head))).map(heads => ({ format: 'shoal.witnessed-heads/1', heads })))
    fc.assert(fc.property(file, (f) => {
      const r = headsFromFile(f)
      expect(Number.isInteger(r.malformed) && r.malformed >= 0).toBe(true)
      for (const h of r.heads) expect(parseLogHead(h).ok).toBe(true)
    }), runs('witness file: any content', 300))
  })

  describe('key and document files of arbitrary bytes', () => {
    let dir: string
    beforeAll(async () => { dir = await mkdtemp(join(tmpdir(), 'shoal-fuzz-files-')) })
    afterAll(async () => { await rm(dir, { recursive: true, force: true }) })
    const CERT = { name: 'CertificateError', code: 'SHOAL_ERR_CERT_' }

    it('throw CertificateError, never anything else', async () => {
      let n = 0
      await fc.assert(fc.asyncProperty(fc.oneof(fc.uint8Array({ maxLength: 300 }), fc.json({ maxDepth: 3 }).map(j => utf8.encode(j))), async (bytes) => {
        const file = join(dir, `f${n++}`)
        await writeFile(file, bytes, { mode: 0o600 })
        for (const read of [readPrivateKeyFile, readCaCertificateFile, readJsonFile]) {
          try {
            await read(file)
          } catch (err) {
            expect((err as { name?: string }).name, String(err)).toBe(CERT.name)
            expect((err as { code?: string }).code).toMatch(/^SHOAL_ERR_CERT_/)
          }
        }
        await rm(file)
      }), runs('key, CA certificate and JSON files: arbitrary bytes', 60))
    })
  })
})

describe('shard manifests (a model directory\'s manifest.json)', () => {
  const hex = (c: string): string => c.repeat(64)
  const manifest = {
    format: 'shoal-shards/1', modelId: 'm', sourceHash: hex('e'),
    shape: { architecture: 'llama', hiddenSize: 64, numLayers: 4, numHeads: 4, numKvHeads: 2, headDim: 16, intermediateSize: 128, vocabSize: 512, maxPositions: 2048, rmsNormEps: 1e-6, tieWordEmbeddings: false },
    quantization: { kind: 'int4', blockSize: 32, activations: 'int8' }, opSet: 'ort-contrib',
    generation: { bosTokenId: 507, eosTokenIds: [508], addBosToken: true, tokenizerAddsBos: true },
    tokenizerFiles: [{ path: 'tokenizer.json', sha256: hex('a'), bytes: 14663 }],
    stages: [
      { index: 0, layers: [0, 1], hasEmbedding: true, hasHead: false, dir: 'stage-0', graph: 'stage-0/model.onnx', files: [{ path: 'stage-0/model.onnx', sha256: hex('b'), bytes: 1 }] },
      { index: 1, layers: [2, 3], hasEmbedding: false, hasHead: true, dir: 'stage-1', graph: 'stage-1/model.onnx', files: [{ path: 'stage-1/model.onnx', sha256: hex('c'), bytes: 1 }] },
    ],
  }
  const MANIFEST = { name: 'ManifestError', code: 'SHOAL_ERR_MANIFEST' }

  it('any JSON value, and a valid manifest with any one value replaced, is a manifest or a ManifestError', () => {
    expect(validateManifest(JSON.parse(JSON.stringify(manifest)))).toBeDefined()
    fc.assert(fc.property(anyJson, (v) => { expectTyped(() => validateManifest(v), MANIFEST, v) }), runs('manifest: arbitrary JSON', 200))
    // Every path in the manifest, set to any JSON value (null, a wrong type, …).
    const paths: Array<Array<string | number>> = []
    const walk = (v: unknown, p: Array<string | number>): void => {
      paths.push(p)
      if (Array.isArray(v)) v.forEach((x, i) => walk(x, [...p, i]))
      else if (typeof v === 'object' && v !== null) for (const [k, x] of Object.entries(v)) walk(x, [...p, k])
    }
    walk(manifest, [])
    // A counterexample a run found: an object whose toString is not a function, where the message
    // interpolated the value (a TypeError, not a ManifestError).
    const found = JSON.parse(JSON.stringify(manifest)) as { stages: Array<Record<string, unknown>> }
    found.stages[0]!.index = { toString: '' }
    expectTyped(() => validateManifest(found), MANIFEST, found)
    fc.assert(fc.property(fc.constantFrom(...paths.filter(p => p.length > 0)), anyJson, (p, value) => {
      const doc = JSON.parse(JSON.stringify(manifest)) as Record<string | number, any>
      let parent = doc
      for (const k of p.slice(0, -1)) parent = parent[k]
      parent[p[p.length - 1]!] = value
      expectTyped(() => validateManifest(doc), MANIFEST, doc)
    }), runs('manifest: one value replaced', 400))
  })
})

describe('checkpoint files (what `shoal compile` reads)', () => {
  let dir: string
  beforeAll(async () => { dir = await mkdtemp(join(tmpdir(), 'shoal-fuzz-ckpt-')) })
  afterAll(async () => { await rm(dir, { recursive: true, force: true }) })
  const CHECKPOINT = { name: 'CheckpointError', code: 'SHOAL_ERR_CHECKPOINT' }
  let n = 0

  /** A safetensors file: u64 header length, the header, then `data` bytes. */
  const file = (header: string, data: number): Uint8Array => {
    const h = utf8.encode(header)
    const out = new Uint8Array(8 + h.length + data)
    new DataView(out.buffer).setBigUint64(0, BigInt(h.length), true)
    out.set(h, 8)
    return out
  }
  const entry = fc.record({
    dtype: fc.oneof(fc.constantFrom('F32', 'F16', 'BF16', 'I8', 'F8_E4M3'), anyJson),
    shape: fc.oneof(fc.array(fc.nat({ max: 6 }), { maxLength: 3 }), fc.array(fc.nat({ max: 2 ** 40 }), { maxLength: 2 }), anyJson),
    data_offsets: fc.oneof(fc.tuple(fc.nat({ max: 64 }), fc.nat({ max: 64 })), fc.tuple(fc.nat({ max: 64 }), fc.maxSafeNat()), anyJson),
  }, { requiredKeys: [] })
  const header = fc.oneof(fc.dictionary(fc.string({ maxLength: 6 }), fc.oneof(entry, anyJson), { maxKeys: 4 }).map(h => JSON.stringify(h)), fc.json({ maxDepth: 2 }), fc.string({ maxLength: 40 }))

  it('any header and data: tensors of the size their shape says, or a CheckpointError — never an allocation of what an offset claims', async () => {
    await fc.assert(fc.asyncProperty(header, fc.nat({ max: 64 }), async (h, data) => {
      const d = join(dir, `c${n++}`)
      await mkdir(d)
      await writeFile(join(d, 'model.safetensors'), file(h, data))
      try {
        const store = await expectTypedAsync(() => openWeights(d), CHECKPOINT, h)
        for (const name of store?.names() ?? []) {
          const t = await expectTypedAsync(() => store!.get(name), CHECKPOINT, h)
          if (t !== undefined) expect(t.data.length).toBe(t.shape.reduce((a, b) => a * b, 1))
        }
      } finally {
        await rm(d, { recursive: true })
      }
    }), runs('checkpoint: safetensors header and data', 150))
  })

  it('tensors written round-trip', async () => {
    await fc.assert(fc.asyncProperty(fc.array(fc.tuple(fc.nat({ max: 4 }), fc.nat({ max: 4 })), { minLength: 1, maxLength: 3 }), async (shapes) => {
      const d = join(dir, `w${n++}`)
      await mkdir(d)
      const tensors = shapes.map(([r, c], i) => ({ name: `t${i}`, shape: [r, c], data: Float32Array.from({ length: r * c }, (_, j) => j - i) }))
      await writeSafetensors(join(d, 'model.safetensors'), tensors)
      const store = await openWeights(d)
      for (const t of tensors) expect(await store.get(t.name)).toEqual({ shape: t.shape, data: t.data })
      await rm(d, { recursive: true })
    }), runs('checkpoint: round trip', 30))
  })
})

describe('command line and worker messages', () => {
  it('--api and --model: a value or ConfigError', () => {
    const CONFIG = { name: 'ConfigError', code: 'SHOAL_ERR_CONFIG' }
    const arg = fc.oneof(fc.string({ unit: 'binary', maxLength: 40 }), fc.tuple(fc.string({ maxLength: 10 }), fc.string({ unit: fc.constantFrom(...'0123456789-@:[]'), maxLength: 30 })).map(([a, b]) => a + b))
    fc.assert(fc.property(arg, (s) => {
      const api = expectTyped(() => parseApiAddress(s), CONFIG, s)
      if (api !== undefined) expect(Number.isInteger(api.port) && api.port >= 0 && api.port <= 65535 && typeof api.host === 'string').toBe(true)
      const model = expectTyped(() => parseModelEntry(s), CONFIG, s)
      if (model?.layers !== undefined) expect(model.layers[0] <= model.layers[1]).toBe(true)
    }), runs('config: --api and --model values', 300))
  })

  it('the engine worker\'s message check returns a message or an error text for any value', () => {
    const typed = fc.oneof(
      fc.constant(new BigInt64Array([1n, 2n])), fc.constant(new Float32Array(4)), fc.constant(new Uint8Array(2)), fc.constant(undefined),
    )
    const anything = fc.oneof(anyJson, typed, fc.anything({ maxDepth: 2 }))
    const message = fc.record({
      type: fc.oneof(fc.constantFrom('open', 'step', 'step-batch', 'free', 'cancel', 'stats', 'close', 'rollback', 'retain', 'open-from', 'evict'), anything),
      id: fc.oneof(fc.nat(), anything), seqId: fc.oneof(fc.string(), anything), length: anything, maxLength: anything, key: anything, keys: anything,
      positions: anything, logitsToKeep: anything, pick: fc.oneof(fc.record({ temperature: anything, topP: anything, u: anything }), anything),
      input: fc.oneof(fc.record({ kind: fc.constantFrom('tokens', 'hidden'), ids: typed, data: typed }), anything),
      items: fc.oneof(fc.array(anything, { maxLength: 3 }), anything),
    }, { requiredKeys: [] })
    fc.assert(fc.property(fc.oneof(message, anything), (m) => {
      const r = parseToWorker(m)
      expect(typeof r === 'string' || (typeof r === 'object' && r !== null)).toBe(true)
    }), runs('engine protocol: messages to the worker', 400))
  })
})
