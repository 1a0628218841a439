import { describe, expect, it } from 'vitest'
import { DEFAULT_BUDGETS, chooseEngine, parseApiAddress, parseModelEntry, validateConfig } from '../../daemon/node/index.ts'
import type { DaemonConfig } from '../../daemon/node/index.ts'

const base: DaemonConfig = { models: [{ dir: 'demo' }], device: 'auto', dataDir: '/tmp/d', cacheRoot: '/tmp/c', listen: [], bootstrap: [], mdns: false }

describe('daemon config', () => {
  it('parses API addresses', () => {
    expect(parseApiAddress('127.0.0.1:8080')).toEqual({ host: '127.0.0.1', port: 8080 })
    expect(parseApiAddress(':9000')).toEqual({ host: '127.0.0.1', port: 9000 })
    expect(parseApiAddress('[::1]:80')).toEqual({ host: '::1', port: 80 })
    for (const bad of ['8080', 'host:', 'host:99999', 'a:b:c', '']) {
      expect(() => parseApiAddress(bad), bad).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_CONFIG', key: '--api' }))
    }
  })

  it('parses model specs with and without a layer range', () => {
    expect(parseModelEntry('/m')).toEqual({ dir: '/m' })
    expect(parseModelEntry('/m@0-11')).toEqual({ dir: '/m', layers: [0, 11] })
    expect(parseModelEntry('/weird@name')).toEqual({ dir: '/weird@name' })
    expect(() => parseModelEntry('/m@5-2')).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_CONFIG' }))
  })

  it('validates, resolves paths and freezes', () => {
    const c = validateConfig({ ...base, models: [{ dir: 'rel/model' }], dataDir: 'data' })
    expect(c.models[0]!.dir.startsWith('/')).toBe(true)
    expect(c.dataDir.startsWith('/')).toBe(true)
    expect(Object.isFrozen(c)).toBe(true)
    expect(Object.isFrozen(c.models)).toBe(true)
    expect(validateConfig(base).models[0]!.dir).toBe('demo')
  })

  it('fills in the three latency budgets and refuses nonsense ones by name', () => {
    expect(validateConfig(base).budgets).toEqual(DEFAULT_BUDGETS)
    expect(validateConfig({ ...base, budgets: { networkIdleMs: 5000 } }).budgets).toEqual({ ...DEFAULT_BUDGETS, networkIdleMs: 5000 })
    expect(() => validateConfig({ ...base, budgets: { batchBudgetMs: -1 } })).toThrowError(/budgets\.batchBudgetMs/)
    expect(() => validateConfig({ ...base, budgets: { batchBudgetMS: 5 } as never })).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_CONFIG', key: 'budgets.batchBudgetMS' }))
  })

  it('takes --hold-experts on a mesh node only, with a positive --expert-memory-mb, and resolves its directory', () => {
    const node = { ...base, models: [], identityDir: '/tmp/id' }
    const c = validateConfig({ ...node, holdExperts: { dir: 'rel/experts', memoryMb: 0.5 } })
    expect(c.holdExperts).toEqual({ dir: expect.stringMatching(/^\/.*rel\/experts$/), memoryMb: 0.5 })
    expect(Object.isFrozen(c.holdExperts)).toBe(true)
    expect(() => validateConfig({ ...base, holdExperts: { dir: '/e' } })).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_CONFIG', key: '--hold-experts' }))
    for (const memoryMb of [0, -1, Number.NaN, Number.POSITIVE_INFINITY]) {
      expect(() => validateConfig({ ...node, holdExperts: { dir: '/e', memoryMb } })).toThrowError(expect.objectContaining({ key: '--expert-memory-mb' }))
    }
  })

  it('takes --kv-cache-mb as a whole number of MiB (0: no prefix reuse) and names it when it is not', () => {
    expect(validateConfig({ ...base, kvCacheMb: 0 }).kvCacheMb).toBe(0)
    expect(validateConfig({ ...base, kvCacheMb: 512 }).kvCacheMb).toBe(512)
    expect(validateConfig(base).kvCacheMb).toBeUndefined()
    for (const bad of [-1, 1.5, Number.NaN]) {
      expect(() => validateConfig({ ...base, kvCacheMb: bad }), String(bad)).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_CONFIG', key: '--kv-cache-mb' }))
    }
  })

  it('takes the components\' own settings as typed sections, keeps what is absent at the component default, and names a bad key', () => {
    expect(validateConfig(base).routing).toBeUndefined()
    const c = validateConfig({
      ...base,
      routing: { replica: { staleAfterMs: 1_000, affinitySlackRatio: 0 }, chain: { hopCostMs: 0 }, prefix: { minSavedMs: 1e9 } },
      meshTimings: { admissionDeadlineMs: 2_000 },
      ingress: { receiveTimeoutMs: 30_000, maxConcurrentRequests: 8 },
    })
    expect(c.routing).toEqual({ replica: { staleAfterMs: 1_000, affinitySlackRatio: 0 }, chain: { hopCostMs: 0 }, prefix: { minSavedMs: 1e9 } })
    expect(c.meshTimings).toEqual({ admissionDeadlineMs: 2_000 })
    expect(c.ingress).toEqual({ receiveTimeoutMs: 30_000, maxConcurrentRequests: 8 })
    expect(Object.isFrozen(c.ingress)).toBe(true)
    expect(() => validateConfig({ ...base, meshTimings: { admissionDeadlineMs: 0 } })).toThrowError(/meshTimings\.admissionDeadlineMs/)
    expect(() => validateConfig({ ...base, ingress: { receiveTimeoutMs: Number.NaN } })).toThrowError(/ingress\.receiveTimeoutMs/)
    expect(() => validateConfig({ ...base, routing: { replica: { staleAfterMs: -1 } } })).toThrowError(/routing\.replica\.staleAfterMs/)
    expect(() => validateConfig({ ...base, routing: { prefix: { minSavedRatio: -0.1 } } })).toThrowError(/routing\.prefix\.minSavedRatio/)
    expect(() => validateConfig({ ...base, routing: { prefix: { minSavedMS: 5 } as never } })).toThrowError(expect.objectContaining({ key: 'routing.prefix.minSavedMS' }))
    // A typo is an error, not a silent default.
    expect(() => validateConfig({ ...base, ingress: { maxConcurrentRequest: 8 } as never })).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_CONFIG', key: 'ingress.maxConcurrentRequest' }))
  })

  it('takes --activations f32, f16 or int8 (absent: f32) and names it otherwise', () => {
    expect(validateConfig(base).activations).toBeUndefined()
    expect(validateConfig({ ...base, activations: 'int8' }).activations).toBe('int8')
    expect(() => validateConfig({ ...base, activations: 'bf16' as 'f16' })).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_CONFIG', key: '--activations' }))
  })

  it('takes --kernels auto or onnxruntime (absent: auto) and names it otherwise', () => {
    expect(validateConfig(base).kernels).toBeUndefined()
    expect(validateConfig({ ...base, kernels: 'onnxruntime' }).kernels).toBe('onnxruntime')
    expect(() => validateConfig({ ...base, kernels: 'native' as 'auto' })).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_CONFIG', key: '--kernels' }))
  })

  it('names the bad key', () => {
    expect(() => validateConfig({ ...base, device: 'tpu' })).toThrowError(/--device/)
    expect(() => validateConfig({ ...base, models: [] })).toThrowError(/--model/)
    // A mesh node may serve nothing (pure ingress/router).
    expect(validateConfig({ ...base, models: [], identityDir: '/id' }).models).toEqual([])
  })
})

describe('engine choice', () => {
  it('prefers OpenVINO for auto when it loads, onnxruntime otherwise', () => {
    expect(chooseEngine('auto', true)).toEqual({ backend: 'openvino', device: 'AUTO' })
    expect(chooseEngine('auto', false)).toEqual({ backend: 'onnxruntime', device: 'CPU' })
    expect(chooseEngine('cpu', true)).toEqual({ backend: 'onnxruntime', device: 'CPU' })
    expect(chooseEngine('NPU', true)).toEqual({ backend: 'openvino', device: 'NPU' })
  })

  it('refuses an OpenVINO device where OpenVINO is missing, with a typed error', () => {
    expect(() => chooseEngine('GPU', false)).toThrowError(expect.objectContaining({ code: 'SHOAL_ERR_BACKEND_UNAVAILABLE' }))
  })
})
