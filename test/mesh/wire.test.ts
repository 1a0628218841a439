/** Golden bytes of every mesh wire format, and how each decoder refuses bad input. */
import { describe, expect, it } from 'vitest'
import { codeOf } from '../support/errors.ts'
import * as lp from 'it-length-prefixed'
import { decodeAdmitFrame, encodeAdmitFrame, helloFrame, refusedFrame, ADMIT_PROTOCOL, ADMIT_MAX_FRAME } from '../../daemon/mesh/wire/admit.ts'
import { decodeLoadFrame, encodeLoadFrame, LOAD_PROTOCOL, LOAD_MAX_FRAME, LOAD_MAX_PREFIXES } from '../../daemon/mesh/wire/load.ts'
import { capabilityBody, decodeCapsMessage, encodeCapsMessage, CAPS_TOPIC, CAPS_MAX_MESSAGE } from '../../daemon/mesh/wire/caps.ts'
import { decodeRevocationsMessage, encodeRevocationsMessage, REVOCATIONS_TOPIC } from '../../daemon/mesh/wire/revocations.ts'
import { errorFrame } from '../../daemon/mesh/wire/frame.ts'

const text = (b: Uint8Array): string => new TextDecoder().decode(b)
const bytes = (s: string): Uint8Array => new TextEncoder().encode(s)
const cert = { body: { name: 'n' }, signature: 'sig' }

describe('protocol ids are versioned', () => {
  it('pins the ids', () => {
    expect([ADMIT_PROTOCOL, LOAD_PROTOCOL, CAPS_TOPIC, REVOCATIONS_TOPIC]).toEqual(['/shoal/admit/1.0.0', '/shoal/load/1.0.0', '/shoal/caps/1', '/shoal/revocations/1'])
  })
})

describe('admit frames', () => {
  it('pins hello, accept, refused and error bytes', () => {
    expect(text(encodeAdmitFrame(helloFrame(cert)))).toBe('{"certificate":{"body":{"name":"n"},"signature":"sig"},"type":"hello","v":1}')
    expect(text(encodeAdmitFrame(helloFrame(cert, { body: { number: 2 }, signature: 'r' })))).toBe('{"certificate":{"body":{"name":"n"},"signature":"sig"},"revocations":{"body":{"number":2},"signature":"r"},"type":"hello","v":1}')
    expect(text(encodeAdmitFrame({ v: 1, type: 'accept' }))).toBe('{"type":"accept","v":1}')
    expect(text(encodeAdmitFrame(refusedFrame('revoked', 'serial 00 is revoked')))).toBe('{"detail":"serial 00 is revoked","reason":"revoked","type":"refused","v":1}')
    expect(text(encodeAdmitFrame(errorFrame('SHOAL_ERR_MESH_MALFORMED', 'bad')))).toBe('{"code":"SHOAL_ERR_MESH_MALFORMED","message":"bad","type":"error","v":1}')
  })

  it('is length-prefixed with an unsigned varint', () => {
    const framed = lp.encode.single(encodeAdmitFrame({ v: 1, type: 'accept' })).subarray()
    expect(Array.from(framed.subarray(0, 1))).toEqual([23])
    expect(text(framed.subarray(1))).toBe('{"type":"accept","v":1}')
  })

  it('round-trips', () => {
    const frame = helloFrame(cert, { x: 1 })
    expect(decodeAdmitFrame(encodeAdmitFrame(frame))).toEqual(frame)
    expect(decodeAdmitFrame(encodeAdmitFrame(refusedFrame('expired', 'd')))).toEqual(refusedFrame('expired', 'd'))
  })

  it('refuses bad frames with typed codes', () => {
    expect(codeOf(() => decodeAdmitFrame(bytes('not json')))).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(codeOf(() => decodeAdmitFrame(bytes('[1]')))).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(codeOf(() => decodeAdmitFrame(bytes('{"v":2,"type":"hello"}')))).toBe('SHOAL_ERR_MESH_UNSUPPORTED_VERSION')
    expect(codeOf(() => decodeAdmitFrame(bytes('{"v":1,"type":"what"}')))).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(codeOf(() => decodeAdmitFrame(bytes('{"v":1,"type":"hello","certificate":"x"}')))).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(codeOf(() => decodeAdmitFrame(new Uint8Array(ADMIT_MAX_FRAME + 1)))).toBe('SHOAL_ERR_MESH_TOO_LARGE')
    expect(codeOf(() => encodeAdmitFrame(helloFrame({ big: 'x'.repeat(ADMIT_MAX_FRAME) })))).toBe('SHOAL_ERR_MESH_TOO_LARGE')
    expect(codeOf(() => decodeAdmitFrame(bytes('{"v":1,"type":"error","code":"NOPE","message":"m"}')))).toBe('SHOAL_ERR_MESH_MALFORMED')
  })
})

describe('load frames', () => {
  const load = { queueDepth: 2, inFlight: 3, decodeTokPerSec: 41.5, freeKvTokens: 8192, expectedWaitMs: 120 }
  it('pins request, reply and error bytes (request id in each)', () => {
    expect(text(encodeLoadFrame({ v: 1, type: 'req', id: 7 }))).toBe('{"id":7,"type":"req","v":1}')
    expect(text(encodeLoadFrame({ v: 1, type: 'load', id: 7, load }))).toBe('{"id":7,"load":{"decodeTokPerSec":41.5,"expectedWaitMs":120,"freeKvTokens":8192,"inFlight":3,"queueDepth":2},"type":"load","v":1}')
    expect(text(encodeLoadFrame(errorFrame('SHOAL_ERR_MESH_RATE_LIMITED', 'slow down', 7)))).toBe('{"code":"SHOAL_ERR_MESH_RATE_LIMITED","id":7,"message":"slow down","type":"error","v":1}')
  })

  it('carries the optional slots, accepting and fromYou fields', () => {
    expect(text(encodeLoadFrame({ v: 1, type: 'load', id: 1, load: { ...load, slots: 4, accepting: false } }))).toBe('{"id":1,"load":{"accepting":false,"decodeTokPerSec":41.5,"expectedWaitMs":120,"freeKvTokens":8192,"inFlight":3,"queueDepth":2,"slots":4},"type":"load","v":1}')
    expect(decodeLoadFrame(encodeLoadFrame({ v: 1, type: 'load', id: 1, load: { ...load, slots: 4, accepting: false } }))).toMatchObject({ load: { slots: 4, accepting: false } })
    expect(codeOf(() => decodeLoadFrame(bytes(JSON.stringify({ v: 1, type: 'load', id: 1, load: { ...load, accepting: 'yes' } }))))).toBe('SHOAL_ERR_MESH_MALFORMED')
    // The asker's own share, in a reply to that asker.
    expect(text(encodeLoadFrame({ v: 1, type: 'load', id: 2, load: { ...load, fromYou: 1 } }))).toBe('{"id":2,"load":{"decodeTokPerSec":41.5,"expectedWaitMs":120,"freeKvTokens":8192,"fromYou":1,"inFlight":3,"queueDepth":2},"type":"load","v":1}')
    expect(decodeLoadFrame(encodeLoadFrame({ v: 1, type: 'load', id: 2, load: { ...load, fromYou: 1 } }))).toMatchObject({ load: { fromYou: 1 } })
    expect(codeOf(() => decodeLoadFrame(bytes(JSON.stringify({ v: 1, type: 'load', id: 1, load: { ...load, fromYou: -1 } }))))).toBe('SHOAL_ERR_MESH_MALFORMED')
  })

  it('carries the optional prefix summary: at most 64 compact block hashes of 16 lowercase hex digits', () => {
    const prefixes = ['0123456789abcdef', 'fedcba9876543210']
    expect(text(encodeLoadFrame({ v: 1, type: 'load', id: 3, load: { ...load, prefixes } }))).toBe('{"id":3,"load":{"decodeTokPerSec":41.5,"expectedWaitMs":120,"freeKvTokens":8192,"inFlight":3,"prefixes":["0123456789abcdef","fedcba9876543210"],"queueDepth":2},"type":"load","v":1}')
    expect(decodeLoadFrame(encodeLoadFrame({ v: 1, type: 'load', id: 3, load: { ...load, prefixes } }))).toEqual({ v: 1, type: 'load', id: 3, load: { ...load, prefixes } })
    // A full summary fits a frame.
    const full = Array.from({ length: LOAD_MAX_PREFIXES }, (_, i) => i.toString(16).padStart(16, 'f'))
    expect(decodeLoadFrame(encodeLoadFrame({ v: 1, type: 'load', id: 4, load: { ...load, slots: 8, accepting: true, fromYou: 3, prefixes: full } }))).toMatchObject({ load: { prefixes: full } })
    // The node's measured prefill rate travels with its summary; a bad one is refused.
    expect(text(encodeLoadFrame({ v: 1, type: 'load', id: 5, load: { ...load, prefillTokPerSec: 3200.5 } }))).toContain('"prefillTokPerSec":3200.5')
    expect(decodeLoadFrame(encodeLoadFrame({ v: 1, type: 'load', id: 5, load: { ...load, prefillTokPerSec: 3200.5 } }))).toMatchObject({ load: { prefillTokPerSec: 3200.5 } })
    for (const bad of [-1, '3', null]) {
      expect(codeOf(() => decodeLoadFrame(bytes(JSON.stringify({ v: 1, type: 'load', id: 1, load: { ...load, prefillTokPerSec: bad } })))), JSON.stringify(bad)).toBe('SHOAL_ERR_MESH_MALFORMED')
    }
    for (const bad of [[...full, 'ffffffffffffffff'], ['0123456789ABCDEF'], ['0123456789abcde'], [1], 'x']) {
      expect(codeOf(() => decodeLoadFrame(bytes(JSON.stringify({ v: 1, type: 'load', id: 1, load: { ...load, prefixes: bad } })))), JSON.stringify(bad)).toBe('SHOAL_ERR_MESH_MALFORMED')
    }
  })

  it('ignores unknown load fields, refuses missing or negative ones', () => {
    const reply = decodeLoadFrame(bytes(JSON.stringify({ v: 1, type: 'load', id: 1, load: { ...load, future: 1 } })))
    expect(reply).toEqual({ v: 1, type: 'load', id: 1, load })
    expect(codeOf(() => decodeLoadFrame(bytes(JSON.stringify({ v: 1, type: 'load', id: 1, load: { ...load, queueDepth: -1 } }))))).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(codeOf(() => decodeLoadFrame(bytes('{"v":1,"type":"req","id":-1}')))).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(codeOf(() => decodeLoadFrame(bytes('{"v":1,"type":"req"}')))).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(codeOf(() => decodeLoadFrame(new Uint8Array(LOAD_MAX_FRAME + 1)))).toBe('SHOAL_ERR_MESH_TOO_LARGE')
  })
})

describe('capability gossip message', () => {
  const body = capabilityBody({
    peerId: '12D3KooWtest', name: 'n1', seq: 5, issuedAt: 1000, addrs: ['/ip4/127.0.0.1/udp/1/quic-v1'],
    protocols: ['/shoal/admit/1.0.0'], models: [{ id: 'm', layers: [0, 11], totalLayers: 24 }], engine: 'onnxruntime', device: 'cpu', ingress: undefined,
  })
  it('pins the bytes (undefined fields are left out)', () => {
    expect(text(encodeCapsMessage(cert, { body, signature: 's' }))).toBe(
      '{"certificate":{"body":{"name":"n"},"signature":"sig"},"record":{"body":{"addrs":["/ip4/127.0.0.1/udp/1/quic-v1"],"device":"cpu","engine":"onnxruntime","issuedAt":1000,"models":[{"id":"m","layers":[0,11],"totalLayers":24}],"name":"n1","peerId":"12D3KooWtest","protocols":["/shoal/admit/1.0.0"],"seq":5,"type":"shoal.capabilities","version":1},"signature":"s"},"type":"caps","v":1}')
  })

  it('round-trips and refuses bad records', () => {
    expect(decodeCapsMessage(encodeCapsMessage(cert, { body, signature: 's' })).record.body).toEqual(body)
    const bad = (patch: Record<string, unknown>): string | undefined => codeOf(() => decodeCapsMessage(bytes(JSON.stringify({ v: 1, type: 'caps', certificate: cert, record: { body: { ...body, ...patch }, signature: 's' } }))))
    expect(bad({ seq: -1 })).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(bad({ models: [{ id: 'm', layers: [5, 1] }] })).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(bad({ version: 2 })).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(bad({ addrs: Array(17).fill('/ip4/1.2.3.4') })).toBe('SHOAL_ERR_MESH_MALFORMED')
    expect(codeOf(() => decodeCapsMessage(new Uint8Array(CAPS_MAX_MESSAGE + 1)))).toBe('SHOAL_ERR_MESH_TOO_LARGE')
  })

  it('carries a model\'s drafter (optional: a record without one is unchanged, a bad one refused)', () => {
    const withDrafter = { ...body, models: [{ id: 'm', totalLayers: 24, drafter: 'draft:tiny' }] }
    expect(decodeCapsMessage(encodeCapsMessage(cert, { body: withDrafter, signature: 's' })).record.body.models[0]!.drafter).toBe('draft:tiny')
    expect(text(encodeCapsMessage(cert, { body: withDrafter, signature: 's' }))).toContain('"models":[{"drafter":"draft:tiny","id":"m","totalLayers":24}]')
    const bad = codeOf(() => decodeCapsMessage(bytes(JSON.stringify({ v: 1, type: 'caps', certificate: cert, record: { body: { ...body, models: [{ id: 'm', drafter: 7 }] }, signature: 's' } }))))
    expect(bad).toBe('SHOAL_ERR_MESH_MALFORMED')
  })

  it('carries the experts a holder offers (optional; a bad entry refused)', () => {
    const holder = { ...body, experts: [{ model: 'a'.repeat(64), modelId: 'moe', budgetBytes: 3145728 }] }
    expect(decodeCapsMessage(encodeCapsMessage(cert, { body: holder, signature: 's' })).record.body.experts).toEqual(holder.experts)
    expect(text(encodeCapsMessage(cert, { body: holder, signature: 's' }))).toContain(`"experts":[{"budgetBytes":3145728,"model":"${'a'.repeat(64)}","modelId":"moe"}]`)
    for (const experts of [[{ model: 'k', modelId: 'moe', budgetBytes: -1 }], [{ model: 'k', budgetBytes: 1 }], 'k']) {
      expect(codeOf(() => decodeCapsMessage(bytes(JSON.stringify({ v: 1, type: 'caps', certificate: cert, record: { body: { ...body, experts }, signature: 's' } }))))).toBe('SHOAL_ERR_MESH_MALFORMED')
    }
  })

  it('carries a stage\'s measured step time and the activation encodings it accepts (optional; malformed refused)', () => {
    const withStep = { ...body, models: [{ id: 'm', layers: [0, 11] as [number, number], stepMs: 12.5 }] }
    expect(decodeCapsMessage(encodeCapsMessage(cert, { body: withStep, signature: 's' })).record.body.models[0]!.stepMs).toBe(12.5)
    expect(text(encodeCapsMessage(cert, { body: withStep, signature: 's' }))).toContain('"models":[{"id":"m","layers":[0,11],"stepMs":12.5}]')
    const withEncodings = { ...body, models: [{ id: 'm', layers: [12, 23] as [number, number], activations: ['f16', 'int8'] }] }
    expect(decodeCapsMessage(encodeCapsMessage(cert, { body: withEncodings, signature: 's' })).record.body.models[0]!.activations).toEqual(['f16', 'int8'])
    expect(codeOf(() => decodeCapsMessage(bytes(JSON.stringify({ v: 1, type: 'caps', certificate: cert, record: { body: { ...body, models: [{ id: 'm', activations: 'f16' }] }, signature: 's' } }))))).toBe('SHOAL_ERR_MESH_MALFORMED')
    const withDevices = { ...body, models: [{ id: 'm', devices: ['CPU', 'GPU'] }] }
    expect(decodeCapsMessage(encodeCapsMessage(cert, { body: withDevices, signature: 's' })).record.body.models[0]!.devices).toEqual(['CPU', 'GPU'])
    for (const devices of ['CPU', [1], Array.from({ length: 17 }, () => 'CPU')]) {
      expect(codeOf(() => decodeCapsMessage(bytes(JSON.stringify({ v: 1, type: 'caps', certificate: cert, record: { body: { ...body, models: [{ id: 'm', devices }] }, signature: 's' } }))))).toBe('SHOAL_ERR_MESH_MALFORMED')
    }
    const withKernels = { ...body, models: [{ id: 'm', kernels: ['int4'] }] }
    expect(text(encodeCapsMessage(cert, { body: withKernels, signature: 's' }))).toContain('"models":[{"id":"m","kernels":["int4"]}]')
    expect(decodeCapsMessage(encodeCapsMessage(cert, { body: withKernels, signature: 's' })).record.body.models[0]!.kernels).toEqual(['int4'])
    for (const kernels of ['int4', [4], Array.from({ length: 9 }, () => 'int4'), ['x'.repeat(33)]]) {
      expect(codeOf(() => decodeCapsMessage(bytes(JSON.stringify({ v: 1, type: 'caps', certificate: cert, record: { body: { ...body, models: [{ id: 'm', kernels }] }, signature: 's' } }))))).toBe('SHOAL_ERR_MESH_MALFORMED')
    }
    for (const stepMs of [-1, '3']) {
      expect(codeOf(() => decodeCapsMessage(bytes(JSON.stringify({ v: 1, type: 'caps', certificate: cert, record: { body: { ...body, models: [{ id: 'm', stepMs }] }, signature: 's' } }))))).toBe('SHOAL_ERR_MESH_MALFORMED')
    }
  })
})

describe('revocations gossip message', () => {
  it('pins the bytes', () => {
    expect(text(encodeRevocationsMessage({ body: { number: 3 }, signature: 'r' }))).toBe('{"list":{"body":{"number":3},"signature":"r"},"type":"revocations","v":1}')
    expect(decodeRevocationsMessage(encodeRevocationsMessage({ a: 1 })).list).toEqual({ a: 1 })
    expect(codeOf(() => decodeRevocationsMessage(bytes('{"v":1,"type":"revocations","list":3}')))).toBe('SHOAL_ERR_MESH_MALFORMED')
  })
})
