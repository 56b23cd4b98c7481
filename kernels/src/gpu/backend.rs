//! [`GpuBackend`]: the model's ops on a [`GpuDevice`], one kernel launch per op, staged.
//!
//! The [`Backend`] trait still takes host slices (a device-buffer type in the trait is the
//! engine-core issue's next step), so every op here copies its activations in, launches, and
//! copies its outputs back; weights — and the norms' and KDA's constants, which are weights too —
//! are uploaded once and stay resident. That makes this backend correct, not fast: it is how the
//! built kernels run inside the real model on a device (the device check), and, over
//! `kimi-kpl-host`'s host device, how CI runs the same op mapping on the CPU (the goldens and
//! TP = 2 pass through it there).
//!
//! On the device: BF16 and MXFP4 products (activations as BF16 hi + lo), MLA attention over the
//! paged latent cache, the merge of context-parallel partials, the indexer's scores (its top-k on
//! the host) and the vision tower's attention (Triton, when the device has their builds);
//! embedding, RMSNorm, gated RMSNorm, SiLU / SiTU GLU, GELU, both RoPEs, AttnRes, KDA's
//! convolution and decode step, the router (kpl); MXFP4 routed experts as grouped products
//! (Triton) around SiTU (kpl); KDA over prefill chunks (Triton, its per-token preparation on the
//! host). On the CPU backend still: KDA's speculative verifies (per-token snapshots), MLA attention
//! over indexer selections, MLA absorb / lift, BF16 experts, layer norm, adds and the output gate.
//!
//! The Triton launches are checked in CI by replaying them in Triton's interpreter
//! (`kimi-kpl-host`'s `HostDevice::with_triton`).

use std::collections::HashMap;
use std::sync::Arc;

use bytemuck::Pod;
use parking_lot::Mutex;

use super::abi::{
    AttnResParams, EmbeddingParams, GatedRmsnormParams, GeluParams, GluParams, KdaConvParams, KdaDecodeParams,
    MoeRouteParams, RmsnormParams, RopeTableParams, SituParams as SituAbi,
};
use super::device::{GpuDevice, GpuError, KernelArg, launch_kpl, launch_triton};
use crate::{
    Backend, CpuBackend, ExpertMatrices, Gelu, KdaInputs, KdaParams, KdaSlot, Matrix, PackedMatrix, PagedRows,
    RouterParams, Routing, Selection, SeqSpan, SituParams,
};

/// A weight's resident copy: where it lies on the device, and a sample of its bytes that says the
/// host memory at that address still holds the same weight (a freed matrix's address may be
/// reused by another).
struct Resident {
    ptr: u64,
    sample: Vec<u8>,
}

/// The model's ops on a GPU (see the module's note).
pub struct GpuBackend {
    dev: Arc<dyn GpuDevice>,
    cpu: CpuBackend,
    resident: Mutex<HashMap<(usize, usize), Resident>>,
}

/// Every `len / 64`-th byte of `bytes` (at most 64 of them).
fn sample(bytes: &[u8]) -> Vec<u8> {
    let step = (bytes.len() / 64).max(1);
    bytes.iter().step_by(step).take(64).copied().collect()
}

/// One op's staged buffers: inputs copied in, outputs copied back by [`Stage::finish`], every
/// allocation freed when the stage drops.
struct Stage<'a> {
    dev: &'a dyn GpuDevice,
    allocs: Vec<u64>,
    outputs: Vec<(u64, &'a mut [u8])>,
}

impl<'a> Stage<'a> {
    fn new(dev: &'a dyn GpuDevice) -> Stage<'a> {
        Stage { dev, allocs: Vec::new(), outputs: Vec::new() }
    }

    /// A device copy of `host`.
    fn input<T: Pod>(&mut self, host: &[T]) -> Result<u64, GpuError> {
        let bytes: &[u8] = bytemuck::cast_slice(host);
        let p = self.dev.alloc(bytes.len())?;
        self.allocs.push(p);
        // SAFETY: p was just allocated with bytes.len() bytes.
        unsafe { self.dev.copy_in(p, bytes)? };
        Ok(p)
    }

    /// A device copy of `host` whose final contents are copied back into it.
    fn output<T: Pod>(&mut self, host: &'a mut [T]) -> Result<u64, GpuError> {
        let p = self.input(host)?;
        self.outputs.push((p, bytemuck::cast_slice_mut(host)));
        Ok(p)
    }

    /// Copies every output back (after the launches queued before).
    fn finish(mut self) -> Result<(), GpuError> {
        for (p, host) in std::mem::take(&mut self.outputs) {
            // SAFETY: p was allocated with host.len() bytes by `input`.
            unsafe { self.dev.copy_out(p, host)? };
        }
        Ok(())
    }
}

impl Drop for Stage<'_> {
    fn drop(&mut self) {
        for &p in &self.allocs {
            // SAFETY: each allocation was made by this stage and is freed once.
            unsafe { self.dev.free(p) };
        }
    }
}

/// What the paged kernels (MLA decode, the indexer's scores) read: one arena of the sequences'
/// held pages (each `page_tokens × width` values), a page table `[sequences, max_pages]` naming
/// arena pages or −1 (a hole another context-parallel rank holds, or past a sequence's pages), and
/// each query token's sequence and position. The table covers every position a token may look at:
/// the kernels read it at each block they visit.
struct PagedInputs {
    arena: Vec<f32>,
    table: Vec<i32>,
    max_pages: usize,
    seqs: Vec<i32>,
    pos: Vec<i32>,
}

impl PagedInputs {
    /// `caches` share one page size and width (the callers check).
    fn new(caches: &[PagedRows<'_>], rows: &[(usize, usize)]) -> PagedInputs {
        let (page_tokens, width) = caches.first().map_or((1, 1), |c| (c.page_tokens.max(1), c.width));
        let max_pages =
            caches.iter().map(|c| c.pages.len()).chain(rows.iter().map(|r| r.1 / page_tokens + 1)).max().unwrap_or(1);
        let page = page_tokens * width;
        let mut arena = Vec::new();
        let mut table = vec![-1i32; caches.len() * max_pages];
        for (s, c) in caches.iter().enumerate() {
            for (i, p) in c.pages.iter().enumerate().filter(|(_, p)| !p.is_empty()) {
                table[s * max_pages + i] = (arena.len() / page) as i32;
                let n = p.len().min(page);
                arena.extend_from_slice(&p[..n]);
                arena.resize(arena.len() + page - n, 0.0);
            }
        }
        if arena.is_empty() {
            arena.resize(page.max(1), 0.0);
        }
        let seqs = rows.iter().map(|r| r.0 as i32).collect();
        let pos = rows.iter().map(|r| r.1 as i32).collect();
        PagedInputs { arena, table, max_pages, seqs, pos }
    }
}

/// A device failure inside an op: the [`Backend`] trait has no error path (the CPU backend
/// cannot fail), so it is fatal, as a failed kernel is in every GPU engine.
fn fatal(op: &str, e: GpuError) -> ! {
    panic!("GPU backend, {op}: {e}")
}

impl GpuBackend {
    pub fn new(dev: Arc<dyn GpuDevice>) -> GpuBackend {
        GpuBackend { dev, cpu: CpuBackend, resident: Mutex::new(HashMap::new()) }
    }

    pub fn device(&self) -> &dyn GpuDevice {
        &*self.dev
    }

    fn has(&self, kernel: &str) -> bool {
        self.dev.kernel(kernel).is_some()
    }

    /// The resident device copy of a weight (uploaded on first use).
    fn weight<T: Pod>(&self, host: &[T]) -> Result<u64, GpuError> {
        let bytes: &[u8] = bytemuck::cast_slice(host);
        let key = (bytes.as_ptr() as usize, bytes.len());
        let mut map = self.resident.lock();
        let s = sample(bytes);
        if let Some(r) = map.get(&key) {
            if r.sample == s {
                return Ok(r.ptr);
            }
            // SAFETY: the old copy was allocated here; no launch of an earlier op is pending on
            // it past this op's own synchronisation (every staged op copies its outputs back).
            unsafe { self.dev.free(r.ptr) };
            map.remove(&key);
        }
        let p = self.dev.alloc(bytes.len())?;
        // SAFETY: p was just allocated with bytes.len() bytes.
        unsafe { self.dev.copy_in(p, bytes)? };
        map.insert(key, Resident { ptr: p, sample: s });
        Ok(p)
    }

    /// The resident device copy of several host arrays laid end to end (every expert's matrix of
    /// one kind, as the grouped product reads them), made on first use and re-made if any of
    /// them changes.
    fn stacked(&self, parts: &[&[u8]]) -> Result<u64, GpuError> {
        let Some(head) = parts.first() else { return self.dev.alloc(0) };
        // The key: the first part's address and the number of parts; the sample covers all.
        let key = (head.as_ptr() as usize, usize::MAX - parts.len());
        let s: Vec<u8> = parts.iter().flat_map(|p| sample(p)).collect();
        let mut map = self.resident.lock();
        if let Some(r) = map.get(&key) {
            if r.sample == s {
                return Ok(r.ptr);
            }
            // SAFETY: allocated here; no launch is pending on it (every staged op finishes).
            unsafe { self.dev.free(r.ptr) };
            map.remove(&key);
        }
        let bytes: Vec<u8> = parts.concat();
        let p = self.dev.alloc(bytes.len())?;
        // SAFETY: p was just allocated with bytes.len() bytes.
        unsafe { self.dev.copy_in(p, &bytes)? };
        map.insert(key, Resident { ptr: p, sample: s });
        Ok(p)
    }

    /// Routed experts on `triton_moe_mxfp4`: the batch's (token, choice) pairs grouped by expert,
    /// `w1` and `w3` as two grouped products over the gathered tokens, SiTU (kpl), `w2` as a third,
    /// then each token's weighted sum in expert-id order on the host, as the CPU backend adds.
    /// `false` unless every expert is MXFP4 of one shape.
    fn try_moe_experts(
        &self,
        experts: &[ExpertMatrices<'_>],
        first: usize,
        routing: &Routing,
        z: &[f32],
        act: SituParams,
        out: &mut [f32],
    ) -> Result<bool, GpuError> {
        fn mx<'a>(m: &Matrix<'a>) -> Option<crate::Mxfp4Matrix<'a>> {
            match m {
                Matrix::Mxfp4(m) => Some(*m),
                _ => None,
            }
        }
        let Some(e0) = experts.first() else { return Ok(false) };
        let (Some(a1), Some(a2)) = (mx(&e0.w1), mx(&e0.w2)) else { return Ok(false) };
        let (inter, lat) = (a1.rows, a1.cols);
        let same = experts.iter().all(|e| {
            [(&e.w1, inter, lat), (&e.w3, inter, lat), (&e.w2, lat, inter)]
                .iter()
                .all(|(m, r, c)| mx(m).is_some_and(|m| m.rows == *r && m.cols == *c))
        });
        if !self.has("triton_moe_mxfp4") || !same || a2.rows != lat || lat == 0 || inter == 0 {
            return Ok(false);
        }
        let tokens = z.len() / lat;
        assert!(z.len() == tokens * lat && out.len() == tokens * lat, "moe_experts: shapes");
        out.fill(0.0);
        // Pairs grouped by local expert, tokens in order within a group (as the CPU backend).
        let n_exp = experts.len();
        let local = |k: usize| routing.ids[k].checked_sub(first).filter(|&e| e < n_exp);
        let picks = (tokens * routing.top_k).min(routing.ids.len());
        let mut offsets = vec![0i32; n_exp + 1];
        for k in 0..picks {
            if let Some(e) = local(k) {
                offsets[e + 1] += 1;
            }
        }
        for e in 0..n_exp {
            offsets[e + 1] += offsets[e];
        }
        let pairs = offsets[n_exp] as usize;
        if pairs == 0 {
            return Ok(true);
        }
        let mut rows = vec![0i32; pairs];
        let mut weights = vec![0f32; pairs];
        let mut next: Vec<usize> = offsets.iter().map(|&o| o as usize).collect();
        for k in 0..picks {
            if let Some(e) = local(k) {
                rows[next[e]] = (k / routing.top_k) as i32;
                weights[next[e]] = routing.weights[k];
                next[e] += 1;
            }
        }
        let biggest = (0..n_exp).map(|e| offsets[e + 1] - offsets[e]).max().unwrap_or(0) as usize;
        // Every expert's codes and scales of one matrix: w1 (0), w3 (1) or w2 (2).
        let pick = |which: usize| -> (Vec<&[u8]>, Vec<&[u8]>) {
            experts
                .iter()
                .map(|e| match [e.w1, e.w3, e.w2][which] {
                    Matrix::Mxfp4(m) => (m.packed, m.scales),
                    _ => (&[][..], &[][..]),
                })
                .unzip()
        };
        let identity: Vec<i32> = (0..pairs as i32).collect();
        let (mut a, mut u, mut y) = (vec![0f32; pairs * inter], vec![0f32; pairs * inter], vec![0f32; pairs * lat]);
        let dev = &*self.dev;
        // One grouped product: `dst[p] = W_{expert(p)} · src[rows[p]]`.
        let grouped =
            |which: usize, src: &[f32], rows: &[i32], n: usize, k: usize, dst: &mut [f32]| -> Result<(), GpuError> {
                let (q, sc) = pick(which);
                let mut st = Stage::new(dev);
                let args = [
                    KernelArg::Ptr(st.input(src)?),
                    KernelArg::Ptr(st.input(rows)?),
                    KernelArg::Ptr(st.input(&offsets)?),
                    KernelArg::Ptr(self.stacked(&q)?),
                    KernelArg::Ptr(self.stacked(&sc)?),
                    KernelArg::Ptr(st.output(dst)?),
                    KernelArg::I32(n as i32),
                    KernelArg::I32(k as i32),
                    KernelArg::I32(k as i32),
                    KernelArg::I32(n as i32),
                ];
                // The build's tiles (kernels/triton/aot.py): 16 pairs by 64 outputs a program.
                let grid = (n_exp as u32, biggest.div_ceil(16) as u32, n.div_ceil(64) as u32);
                // SAFETY: src holds the rows the pairs name (k values each), the stacked weights every
                // expert's [n, k] MXFP4 matrix, dst pairs × n values; the stage keeps them.
                unsafe { launch_triton(dev, "triton_moe_mxfp4", grid, &args)? };
                st.finish()
            };
        grouped(0, z, &rows, inter, lat, &mut a)?;
        grouped(1, z, &rows, inter, lat, &mut u)?;
        self.try_glu(&mut a, &u, Some(act))?;
        grouped(2, &a, &identity, lat, inter, &mut y)?;
        for (p, (&t, &w)) in rows.iter().zip(&weights).enumerate() {
            let t = t as usize;
            crate::cpu::simd::axpy(w, &y[p * lat..(p + 1) * lat], &mut out[t * lat..(t + 1) * lat]);
        }
        Ok(true)
    }

    /// Blocks for a grid-stride kernel over `n` values: enough to cover them, at most what fills
    /// the device.
    fn stride_grid(&self, n: usize) -> u32 {
        (n.div_ceil(self.block() as usize) as u32).clamp(1, self.dev.parallel_blocks().max(1))
    }

    /// Threads a block for the row and grid-stride kernels: one wave (the kpl kernels reduce
    /// within a block of any whole number of waves; one keeps them comparable with the host).
    fn block(&self) -> u32 {
        self.dev.wave()
    }

    /// `kpl_rope_table_f32` over `x` (`[rows, heads, head_stride]`) with tables `[rows, pairs]`.
    #[allow(clippy::too_many_arguments)]
    fn rope_table(
        &self,
        x: &mut [f32],
        cos: &[f32],
        sin: &[f32],
        heads: usize,
        head_stride: usize,
        offset: usize,
    ) -> Result<(), GpuError> {
        let row = heads * head_stride;
        let rows = x.len() / row.max(1);
        let pairs = cos.len() / rows.max(1);
        assert!(
            x.len() == rows * row
                && cos.len() == rows * pairs
                && sin.len() == cos.len()
                && offset + 2 * pairs <= head_stride,
            "rope: shapes"
        );
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let p = RopeTableParams {
            cos: st.input(cos)?,
            sin: st.input(sin)?,
            x: st.output(x)?,
            rows: rows as u32,
            heads: heads as u32,
            head_stride: head_stride as u32,
            offset: offset as u32,
            pairs: pairs as u32,
            pad_: 0,
        };
        // SAFETY: x holds rows × heads × head_stride values and every turned lane lies inside its
        // head; cos and sin hold rows × pairs (checked); the stage keeps them until it finishes.
        unsafe { launch_kpl(dev, "kpl_rope_table_f32", self.stride_grid(rows * heads * pairs), self.block(), &p)? };
        st.finish()
    }

    /// A BF16 or MXFP4 product on the Triton kernels; `false` when this device has no build of
    /// the one needed (or the weight is in another format).
    fn triton_matmul(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]) -> Result<bool, GpuError> {
        let (n, k) = (w.rows(), w.cols());
        let (name, weights) = match w {
            Matrix::Bf16(m) if self.has("triton_matmul_bf16") => ("triton_matmul_bf16", vec![self.weight(m.data)?]),
            Matrix::Mxfp4(m) if self.has("triton_matmul_mxfp4") => {
                ("triton_matmul_mxfp4", vec![self.weight(m.packed)?, self.weight(m.scales)?])
            }
            _ => return Ok(false),
        };
        assert!(x.len() == tokens * k && out.len() == tokens * n, "matmul: shapes");
        if tokens == 0 || n == 0 {
            return Ok(true);
        }
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let mut args = vec![KernelArg::Ptr(st.input(x)?)];
        args.extend(weights.into_iter().map(KernelArg::Ptr));
        args.push(KernelArg::Ptr(st.output(out)?));
        args.extend([tokens, n, k, k, n].map(|v| KernelArg::I32(v as i32)));
        // The builds' tiles: 16 token rows by 64 outputs a program (kernels/triton/aot.py).
        let grid = (tokens.div_ceil(16) as u32, n.div_ceil(64) as u32, 1);
        // SAFETY: x holds tokens × k values, out tokens × n (checked), the weight its stored
        // matrix; the stage and the resident map keep them until the stage finishes.
        unsafe { launch_triton(dev, name, grid, &args)? };
        st.finish()?;
        Ok(true)
    }

    /// Absorbed MLA attention on `triton_mla_decode` (one split: every position in one pass),
    /// over a page arena staged from the sequences' held pages and a page table with −1 for
    /// holes; `false` when this device has no build of it or the call is outside what its build
    /// covers (indexer selections, rank past 512, rope past 64, pages not a multiple of 16 rows).
    #[allow(clippy::too_many_arguments)]
    fn try_mla_attention(
        &self,
        q: &[f32],
        heads: usize,
        rank: usize,
        scale: f32,
        rows: &[(usize, usize)],
        caches: &[PagedRows<'_>],
        ctx: &mut [f32],
        lse: Option<&mut [f32]>,
    ) -> Result<bool, GpuError> {
        // The build's tiles (kernels/triton/aot.py): 16 heads, 16 positions, padded widths.
        const BLOCK_H: usize = 16;
        const BLOCK_S: usize = 16;
        let Some(first) = caches.first() else { return Ok(false) };
        let (page_tokens, width) = (first.page_tokens, first.width);
        let tokens = rows.len();
        if !self.has("triton_mla_decode")
            || tokens == 0
            || rank > 512
            || width < rank
            || width - rank > 64
            || page_tokens == 0
            || !page_tokens.is_multiple_of(BLOCK_S)
            || caches.iter().any(|c| c.page_tokens != page_tokens || c.width != width)
        {
            return Ok(false);
        }
        assert!(
            q.len() == tokens * heads * width
                && ctx.len() == tokens * heads * rank
                && lse.as_ref().is_none_or(|l| l.len() == tokens * heads)
                && rows.iter().all(|&(seq, _)| seq < caches.len()),
            "mla_attention: shapes"
        );
        let PagedInputs { arena, table, max_pages, seqs, pos } = PagedInputs::new(caches, rows);
        // One split covers every position of the table.
        let split_tokens = max_pages * page_tokens;
        let mut scratch_lse;
        let lse = match lse {
            Some(l) => l,
            None => {
                scratch_lse = vec![0f32; tokens * heads];
                &mut scratch_lse[..]
            }
        };
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let args = [
            KernelArg::Ptr(st.input(q)?),
            KernelArg::Ptr(st.input(&arena)?),
            KernelArg::Ptr(st.input(&table)?),
            KernelArg::Ptr(st.input(&seqs)?),
            KernelArg::Ptr(st.input(&pos)?),
            KernelArg::Ptr(st.output(ctx)?),
            KernelArg::Ptr(st.output(lse)?),
            KernelArg::I32(tokens as i32),
            KernelArg::I32(heads as i32),
            KernelArg::I32(rank as i32),
            KernelArg::I32((width - rank) as i32),
            KernelArg::I32(page_tokens as i32),
            KernelArg::I32(max_pages as i32),
            KernelArg::I32(split_tokens as i32),
            KernelArg::F32(scale),
        ];
        let grid = (tokens as u32, heads.div_ceil(BLOCK_H) as u32, 1);
        // SAFETY: q holds tokens × heads × width values, the arena every held page, the table
        // sequences × max_pages entries naming arena pages or −1, ctx and lse their outputs
        // (checked); the stage keeps them until it finishes.
        unsafe { launch_triton(dev, "triton_mla_decode", grid, &args)? };
        st.finish()?;
        Ok(true)
    }

    /// The K3.1 indexer's scores on `triton_indexer_scores` over a staged key arena, the top-k
    /// selected on the host (the CPU backend's `select`); `None` outside what the build covers
    /// (heads past 64, dimension past 128, pages not a multiple of 16 positions).
    #[allow(clippy::too_many_arguments)]
    fn try_indexer_topk(
        &self,
        q: &[f32],
        w: &[f32],
        heads: usize,
        scale: f32,
        topk: usize,
        rows: &[(usize, usize)],
        keys: &[PagedRows<'_>],
    ) -> Result<Option<Vec<Selection>>, GpuError> {
        // The build's tiles (kernels/triton/aot.py).
        const BLOCK_H: usize = 64;
        const BLOCK_S: usize = 16;
        const D_PAD: usize = 128;
        let Some(first) = keys.first() else { return Ok(None) };
        let (page_tokens, d) = (first.page_tokens, first.width);
        let tokens = rows.len();
        if !self.has("triton_indexer_scores")
            || tokens == 0
            || heads == 0
            || heads > BLOCK_H
            || d == 0
            || d > D_PAD
            || page_tokens == 0
            || !page_tokens.is_multiple_of(BLOCK_S)
            || keys.iter().any(|c| c.page_tokens != page_tokens || c.width != d)
        {
            return Ok(None);
        }
        assert!(
            q.len() == tokens * heads * d && w.len() == tokens * heads && rows.iter().all(|&(s, _)| s < keys.len()),
            "indexer_topk: shapes"
        );
        let PagedInputs { arena, table, max_pages, seqs, pos } = PagedInputs::new(keys, rows);
        let s_max = rows.iter().map(|r| r.1 + 1).max().unwrap_or(1);
        let mut scores = vec![0f32; tokens * s_max];
        {
            let dev = &*self.dev;
            let mut st = Stage::new(dev);
            let args = [
                KernelArg::Ptr(st.input(q)?),
                KernelArg::Ptr(st.input(w)?),
                KernelArg::Ptr(st.input(&arena)?),
                KernelArg::Ptr(st.input(&table)?),
                KernelArg::Ptr(st.input(&seqs)?),
                KernelArg::Ptr(st.input(&pos)?),
                KernelArg::Ptr(st.output(&mut scores)?),
                KernelArg::I32(heads as i32),
                KernelArg::I32(d as i32),
                KernelArg::I32(page_tokens as i32),
                KernelArg::I32(max_pages as i32),
                KernelArg::I32(s_max as i32),
                KernelArg::F32(scale),
            ];
            let grid = (tokens as u32, s_max.div_ceil(BLOCK_S) as u32, 1);
            // SAFETY: q holds tokens × heads × d values, w tokens × heads, the arena every held
            // page, the table sequences × max_pages entries naming arena pages or −1, scores
            // tokens × s_max (checked or sized here).
            unsafe { launch_triton(dev, "triton_indexer_scores", grid, &args)? };
            st.finish()?;
        }
        Ok(Some(
            rows.iter()
                .enumerate()
                .map(|(t, &(_, p))| crate::cpu::indexer::select(scores[t * s_max..t * s_max + p + 1].to_vec(), topk))
                .collect(),
        ))
    }

    /// The vision tower's block-diagonal attention on `triton_attention_varlen`; `false` past the
    /// build's head width (128).
    #[allow(clippy::too_many_arguments)]
    fn try_attention_varlen(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        heads: usize,
        dim: usize,
        spans: &[SeqSpan],
        scale: f32,
        out: &mut [f32],
    ) -> Result<bool, GpuError> {
        const BLOCK_M: usize = 64;
        if !self.has("triton_attention_varlen") || dim == 0 || dim > 128 || heads == 0 || spans.is_empty() {
            return Ok(false);
        }
        let width = heads * dim;
        assert!(
            q.len() == out.len()
                && k.len() == out.len()
                && v.len() == out.len()
                && out.len().is_multiple_of(width)
                && spans.iter().all(|s| (s.start + s.len) * width <= out.len()),
            "attention_varlen: shapes"
        );
        // Rows in no span stay zero, as on the CPU.
        out.fill(0.0);
        let starts: Vec<i32> = spans.iter().map(|s| s.start as i32).collect();
        let lens: Vec<i32> = spans.iter().map(|s| s.len as i32).collect();
        let longest = spans.iter().map(|s| s.len).max().unwrap_or(0);
        if longest == 0 {
            return Ok(true);
        }
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let args = [
            KernelArg::Ptr(st.input(q)?),
            KernelArg::Ptr(st.input(k)?),
            KernelArg::Ptr(st.input(v)?),
            KernelArg::Ptr(st.output(out)?),
            KernelArg::Ptr(st.input(&starts)?),
            KernelArg::Ptr(st.input(&lens)?),
            KernelArg::I32(heads as i32),
            KernelArg::I32(dim as i32),
            KernelArg::F32(scale),
        ];
        let grid = (longest.div_ceil(BLOCK_M) as u32, heads as u32, spans.len() as u32);
        // SAFETY: q, k, v and out hold rows × heads × dim values and every span lies inside them
        // (checked).
        unsafe { launch_triton(dev, "triton_attention_varlen", grid, &args)? };
        st.finish()?;
        Ok(true)
    }

    /// The exact merge of context-parallel attention partials on `triton_attention_merge`;
    /// `false` past the build's width (512).
    fn try_attention_merge(
        &self,
        parts: &[&[f32]],
        lses: &[&[f32]],
        width: usize,
        out: &mut [f32],
    ) -> Result<bool, GpuError> {
        const BLOCK_W: usize = 512;
        if !self.has("triton_attention_merge") || parts.is_empty() || width == 0 || width > BLOCK_W {
            return Ok(false);
        }
        let rows = out.len() / width;
        assert!(
            out.len() == rows * width
                && parts.len() == lses.len()
                && parts.iter().all(|p| p.len() == rows * width)
                && lses.iter().all(|l| l.len() == rows),
            "attention_merge: shapes"
        );
        if rows == 0 {
            return Ok(true);
        }
        let stacked: Vec<f32> = parts.concat();
        let stacked_lse: Vec<f32> = lses.concat();
        let mut merged_lse = vec![0f32; rows];
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let args = [
            KernelArg::Ptr(st.input(&stacked)?),
            KernelArg::Ptr(st.input(&stacked_lse)?),
            KernelArg::Ptr(st.output(out)?),
            KernelArg::Ptr(st.output(&mut merged_lse)?),
            KernelArg::I32(rows as i32),
            KernelArg::I32(width as i32),
            KernelArg::I32(parts.len() as i32),
        ];
        // SAFETY: the partials are [splits, rows, width] and their log-sum-exps [splits, rows]
        // (checked); out holds rows × width, the merged log-sum-exp rows.
        unsafe {
            launch_triton(dev, "triton_attention_merge", (rows as u32, width.div_ceil(BLOCK_W) as u32, 1), &args)?
        };
        st.finish()?;
        Ok(true)
    }

    fn try_embedding(&self, table: &Matrix<'_>, ids: &[u32], out: &mut [f32]) -> Result<bool, GpuError> {
        let Matrix::Bf16(t) = table else { return Ok(false) };
        assert_eq!(out.len(), ids.len() * t.cols, "embedding: out has {} values", out.len());
        assert!(ids.iter().all(|&i| (i as usize) < t.rows), "embedding: an id past the table");
        if ids.is_empty() {
            return Ok(true);
        }
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let p = EmbeddingParams {
            table: self.weight(t.data)?,
            ids: st.input(ids)?,
            out: st.output(out)?,
            tokens: ids.len() as u32,
            cols: t.cols as u32,
        };
        // SAFETY: the table holds rows × cols values and every id is below rows (checked); out
        // holds tokens × cols (checked).
        unsafe { launch_kpl(dev, "kpl_embedding_bf16", self.stride_grid(ids.len() * t.cols), self.block(), &p)? };
        st.finish()?;
        Ok(true)
    }

    fn try_rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<(), GpuError> {
        let cols = w.len();
        assert!(x.len() == out.len() && cols > 0 && x.len().is_multiple_of(cols), "rms_norm: shapes");
        let rows = x.len() / cols;
        if rows == 0 {
            return Ok(());
        }
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let p = RmsnormParams {
            x: st.input(x)?,
            w: self.weight(w)?,
            out: st.output(out)?,
            rows: rows as u32,
            cols: cols as u32,
            eps,
            pad_: 0,
        };
        // SAFETY: x and out hold rows × cols values, w cols (checked).
        unsafe { launch_kpl(dev, "kpl_rmsnorm_f32", rows as u32, self.block(), &p)? };
        st.finish()
    }

    fn try_glu(&self, gate: &mut [f32], up: &[f32], act: Option<SituParams>) -> Result<(), GpuError> {
        assert_eq!(gate.len(), up.len(), "glu: shapes");
        if gate.is_empty() {
            return Ok(());
        }
        let n = gate.len();
        let (grid, block) = (self.stride_grid(n), self.block());
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let up = st.input(up)?;
        let gate = st.output(gate)?;
        // SAFETY (both): gate and up hold n values (checked).
        match act {
            None => {
                let p = GluParams { gate, up, n: n as u32, pad_: 0 };
                unsafe { launch_kpl(dev, "kpl_silu_glu_f32", grid, block, &p)? }
            }
            Some(act) => {
                let p = SituAbi {
                    gate,
                    up,
                    n: n as u32,
                    beta: act.beta,
                    linear_beta: act.linear_beta.unwrap_or(0.0),
                    has_linear_beta: act.linear_beta.is_some() as u32,
                };
                unsafe { launch_kpl(dev, "kpl_situ_glu_f32", grid, block, &p)? }
            }
        }
        st.finish()
    }

    fn try_gelu(&self, x: &mut [f32], kind: Gelu) -> Result<(), GpuError> {
        if x.is_empty() {
            return Ok(());
        }
        let n = x.len();
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let p = GeluParams { x: st.output(x)?, n: n as u32, erf: (kind == Gelu::Erf) as u32 };
        // SAFETY: x holds n values.
        unsafe { launch_kpl(dev, "kpl_gelu_f32", self.stride_grid(n), self.block(), &p)? };
        st.finish()
    }

    fn try_attn_res_mix(&self, query: &[f32], eps: f32, cands: &[&[f32]], out: &mut [f32]) -> Result<(), GpuError> {
        let dim = query.len();
        assert!(out.len().is_multiple_of(dim) && cands.iter().all(|c| c.len() == out.len()), "attn_res_mix: shapes");
        let tokens = out.len() / dim;
        if tokens == 0 {
            return Ok(());
        }
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let table: Vec<u64> = cands.iter().map(|c| st.input(c)).collect::<Result<_, _>>()?;
        let p = AttnResParams {
            query: st.input(query)?,
            cands: st.input(&table)?,
            out: st.output(out)?,
            tokens: tokens as u32,
            dim: dim as u32,
            n_cands: cands.len() as u32,
            eps,
        };
        // SAFETY: every candidate and out hold tokens × dim values, the query dim, the table one
        // device address per candidate (checked).
        unsafe { launch_kpl(dev, "kpl_attn_res_mix_f32", tokens as u32, self.block(), &p)? };
        st.finish()
    }

    fn try_kda_conv(
        &self,
        x: &mut [f32],
        spans: &[SeqSpan],
        frames: &mut [&mut [f32]],
        taps: &[f32],
        kernel: usize,
    ) -> Result<(), GpuError> {
        let channels = taps.len() / kernel;
        assert!(
            spans.len() == frames.len()
                && frames.iter().all(|f| f.len() >= (kernel - 1) * channels)
                && spans.iter().all(|s| (s.start + s.len) * channels <= x.len()),
            "kda_conv: shapes"
        );
        let starts: Vec<u32> = spans.iter().map(|s| s.start as u32).collect();
        let lens: Vec<u32> = spans.iter().map(|s| s.len as u32).collect();
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let table: Vec<u64> = frames.iter_mut().map(|f| st.output(&mut f[..])).collect::<Result<_, _>>()?;
        let p = KdaConvParams {
            x: st.output(x)?,
            taps: self.weight(taps)?,
            starts: st.input(&starts)?,
            lens: st.input(&lens)?,
            frames: st.input(&table)?,
            seqs: spans.len() as u32,
            channels: channels as u32,
            kernel: kernel as u32,
            pad_: 0,
        };
        let chunks = channels.div_ceil(self.block() as usize);
        // SAFETY: every span's rows lie in x and every window holds (kernel − 1) × channels
        // values (checked); each sequence's rows and window are its own, and a thread touches
        // one channel of one sequence.
        unsafe { launch_kpl(dev, "kpl_kda_conv_f32", (spans.len() * chunks) as u32, self.block(), &p)? };
        st.finish()
    }

    fn try_kda_decode(
        &self,
        p: &KdaParams<'_>,
        x: &KdaInputs<'_>,
        slots: &mut [KdaSlot<'_>],
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let (h, n) = (p.heads, p.head_dim);
        let seqs = slots.len();
        let width = h * n;
        assert!(
            [x.q, x.k, x.v, x.z].iter().all(|a| a.len() >= seqs * width)
                && x.beta_logits.len() >= seqs * h
                && out.len() >= seqs * width
                && p.a_exp.len() >= h
                && p.dt_bias.len() >= width,
            "kda_recurrence: shapes"
        );
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let table: Vec<u64> =
            slots.iter_mut().map(|s| st.output(&mut s.state[..h * n * n])).collect::<Result<_, _>>()?;
        let params = KdaDecodeParams {
            q: st.input(&x.q[..seqs * width])?,
            k: st.input(&x.k[..seqs * width])?,
            v: st.input(&x.v[..seqs * width])?,
            z: st.input(&x.z[..seqs * width])?,
            beta_logits: st.input(&x.beta_logits[..seqs * h])?,
            a_exp: self.weight(p.a_exp)?,
            dt_bias: self.weight(p.dt_bias)?,
            slots: st.input(&table)?,
            out: st.output(&mut out[..seqs * width])?,
            seqs: seqs as u32,
            heads: h as u32,
            dim: n as u32,
            lower_bound: p.lower_bound,
            q_scale: 1.0 / (n as f32).sqrt(),
            pad_: 0,
        };
        // SAFETY: every input holds seqs rows (checked), every slot heads × dim × dim values, the
        // table one device address per sequence, each its own buffer, so blocks never share state.
        unsafe { launch_kpl(dev, "kpl_kda_decode_f32", (seqs * h) as u32, self.block(), &params)? };
        st.finish()
    }

    /// KDA over a batch of packed spans on `triton_kda_chunk_prefill` (fla's chunked form, chunks
    /// of 16): the per-token preparation the CPU backend does — L2-normalised q (scaled) and k, the
    /// log decays `lower_bound · σ(a_exp · (z + dt_bias))`, β = σ(logits) — on the host, the
    /// recurrence on the device over the sequences' stacked slots.
    fn try_kda_prefill(
        &self,
        p: &KdaParams<'_>,
        x: &KdaInputs<'_>,
        spans: &[SeqSpan],
        slots: &mut [KdaSlot<'_>],
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        use crate::cpu::elementwise::sigmoid;
        use crate::cpu::norm::l2_normalize;
        const BLOCK_V: usize = 32;
        let (h, k) = (p.heads, p.head_dim);
        let width = h * k;
        let tokens: usize = spans.iter().map(|s| s.len).sum();
        assert!(
            [x.q, x.k, x.v, x.z].iter().all(|a| a.len() >= tokens * width)
                && x.beta_logits.len() >= tokens * h
                && out.len() >= tokens * width
                && p.a_exp.len() >= h
                && p.dt_bias.len() >= width,
            "kda_recurrence: shapes"
        );
        let scale = 1.0 / (k as f32).sqrt();
        let (mut q, mut kk) = (x.q[..tokens * width].to_vec(), x.k[..tokens * width].to_vec());
        for r in 0..tokens * h {
            let row = r * k..(r + 1) * k;
            l2_normalize(&mut q[row.clone()], 1e-6);
            q[row.clone()].iter_mut().for_each(|v| *v *= scale);
            l2_normalize(&mut kk[row], 1e-6);
        }
        let g: Vec<f32> = (0..tokens * width)
            .map(|i| {
                let c = i % width;
                p.lower_bound * sigmoid(p.a_exp[c / k] * (x.z[i] + p.dt_bias[c]))
            })
            .collect();
        let beta: Vec<f32> = x.beta_logits[..tokens * h].iter().map(|&b| sigmoid(b)).collect();
        let mut cu = vec![0i32];
        for s in spans {
            cu.push(cu[cu.len() - 1] + s.len as i32);
        }
        let mut state: Vec<f32> = slots.iter().flat_map(|s| s.state[..h * k * k].iter().copied()).collect();
        {
            let dev = &*self.dev;
            let mut st = Stage::new(dev);
            let args = [
                KernelArg::Ptr(st.input(&q)?),
                KernelArg::Ptr(st.input(&kk)?),
                KernelArg::Ptr(st.input(&x.v[..tokens * width])?),
                KernelArg::Ptr(st.input(&g)?),
                KernelArg::Ptr(st.input(&beta)?),
                KernelArg::Ptr(st.output(&mut state)?),
                KernelArg::Ptr(st.output(&mut out[..tokens * width])?),
                KernelArg::Ptr(st.input(&cu)?),
                KernelArg::I32(h as i32),
                KernelArg::I32(k as i32),
                KernelArg::I32(k as i32),
            ];
            let grid = (spans.len() as u32, h as u32, k.div_ceil(BLOCK_V) as u32);
            // SAFETY: q, k, v, g hold tokens × heads × k values, β tokens × heads, the states one
            // [heads, k, k] block a sequence, cu the spans' packed boundaries (checked or built).
            unsafe { launch_triton(dev, "triton_kda_chunk_prefill", grid, &args)? };
            st.finish()?;
        }
        for (slot, s) in slots.iter_mut().zip(state.chunks_exact(h * k * k)) {
            slot.state[..h * k * k].copy_from_slice(s);
        }
        Ok(())
    }

    fn try_gated_rms_norm(
        &self,
        o: &[f32],
        gate: &[f32],
        w: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let dim = w.len();
        assert!(
            o.len() == gate.len() && o.len() == out.len() && dim > 0 && o.len().is_multiple_of(dim),
            "gated_rms_norm"
        );
        let groups = o.len() / dim;
        if groups == 0 {
            return Ok(());
        }
        let dev = &*self.dev;
        let mut st = Stage::new(dev);
        let p = GatedRmsnormParams {
            o: st.input(o)?,
            gate: st.input(gate)?,
            w: self.weight(w)?,
            out: st.output(out)?,
            groups: groups as u32,
            dim: dim as u32,
            eps,
            pad_: 0,
        };
        // SAFETY: o, gate and out hold groups × dim values, w dim (checked).
        unsafe { launch_kpl(dev, "kpl_gated_rmsnorm_f32", groups as u32, self.block(), &p)? };
        st.finish()
    }

    fn try_moe_route(&self, logits: &[f32], tokens: usize, p: &RouterParams<'_>) -> Result<Routing, GpuError> {
        let e = p.bias.len();
        assert_eq!(logits.len(), tokens * e, "moe_route: logits are [tokens, experts]");
        let mut scores = vec![0f32; tokens * e];
        let mut ids = vec![0u32; tokens * p.top_k];
        let mut weights = vec![0f32; tokens * p.top_k];
        let mut margins = vec![0f32; tokens];
        {
            let dev = &*self.dev;
            let mut st = Stage::new(dev);
            let params = MoeRouteParams {
                logits: st.input(logits)?,
                bias: self.weight(p.bias)?,
                scores: st.output(&mut scores)?,
                ids: st.output(&mut ids)?,
                weights: st.output(&mut weights)?,
                margins: st.output(&mut margins)?,
                tokens: tokens as u32,
                experts: e as u32,
                top_k: p.top_k as u32,
                renormalize: p.renormalize as u32,
                scaling: p.scaling,
                pad_: 0,
            };
            // SAFETY: logits hold tokens × experts (checked), bias experts; every output was sized
            // here.
            unsafe { launch_kpl(dev, "kpl_moe_route_f32", tokens as u32, self.block(), &params)? };
            st.finish()?;
        }
        Ok(Routing { ids: ids.into_iter().map(|i| i as usize).collect(), weights, scores, margins, top_k: p.top_k })
    }
}

impl Drop for GpuBackend {
    fn drop(&mut self) {
        for (_, r) in self.resident.lock().drain() {
            // SAFETY: every resident copy was allocated here and is freed once.
            unsafe { self.dev.free(r.ptr) };
        }
    }
}

impl Backend for GpuBackend {
    fn describe(&self) -> String {
        format!("gpu {} (staged; CPU for the ops without a device path: {})", self.dev.describe(), self.cpu.describe())
    }

    fn prepare_matrix(&self, _w: &Matrix<'_>) -> Option<PackedMatrix> {
        // The device reads the stored formats; the CPU fallbacks read them too.
        None
    }

    fn matmul(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]) {
        match self.triton_matmul(w, x, tokens, out) {
            Ok(true) => {}
            Ok(false) => self.cpu.matmul(w, x, tokens, out),
            Err(e) => fatal("matmul", e),
        }
    }

    fn matmul_transposed(&self, w: &Matrix<'_>, x: &[f32], tokens: usize, out: &mut [f32]) {
        self.cpu.matmul_transposed(w, x, tokens, out)
    }

    fn embedding(&self, table: &Matrix<'_>, ids: &[u32], out: &mut [f32]) {
        match self.try_embedding(table, ids, out) {
            Ok(true) => {}
            Ok(false) => self.cpu.embedding(table, ids, out),
            Err(e) => fatal("embedding", e),
        }
    }

    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        self.try_rms_norm(x, w, eps, out).unwrap_or_else(|e| fatal("rms_norm", e))
    }

    fn layer_norm(&self, x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
        self.cpu.layer_norm(x, w, b, eps, out)
    }

    fn silu_glu(&self, gate: &mut [f32], up: &[f32]) {
        self.try_glu(gate, up, None).unwrap_or_else(|e| fatal("silu_glu", e))
    }

    fn rope_interleaved(
        &self,
        x: &mut [f32],
        positions: &[usize],
        heads: usize,
        head_stride: usize,
        offset: usize,
        inv_freq: &[f32],
        magnitude: f32,
    ) {
        // The angles' tables on the host, once per call (as the CPU backend computes them: the
        // angle and its cos / sin in f32), the rotation on the device.
        let pairs = inv_freq.len();
        let (mut cos, mut sin) =
            (Vec::with_capacity(positions.len() * pairs), Vec::with_capacity(positions.len() * pairs));
        for &pos in positions {
            for &f in inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos() * magnitude);
                sin.push(angle.sin() * magnitude);
            }
        }
        self.rope_table(x, &cos, &sin, heads, head_stride, offset).unwrap_or_else(|e| fatal("rope_interleaved", e))
    }

    fn rope_cos_sin(&self, x: &mut [f32], cos: &[f32], sin: &[f32], heads: usize, head_stride: usize) {
        self.rope_table(x, cos, sin, heads, head_stride, 0).unwrap_or_else(|e| fatal("rope_cos_sin", e))
    }

    fn gelu(&self, x: &mut [f32], kind: Gelu) {
        self.try_gelu(x, kind).unwrap_or_else(|e| fatal("gelu", e))
    }

    fn attention_varlen(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        heads: usize,
        dim: usize,
        spans: &[SeqSpan],
        scale: f32,
        out: &mut [f32],
    ) {
        match self.try_attention_varlen(q, k, v, heads, dim, spans, scale, out) {
            Ok(true) => {}
            Ok(false) => self.cpu.attention_varlen(q, k, v, heads, dim, spans, scale, out),
            Err(e) => fatal("attention_varlen", e),
        }
    }

    fn add(&self, acc: &mut [f32], x: &[f32]) {
        self.cpu.add(acc, x)
    }

    fn sigmoid_mul(&self, x: &mut [f32], gate: &[f32]) {
        self.cpu.sigmoid_mul(x, gate)
    }

    fn situ_glu(&self, gate: &mut [f32], up: &[f32], act: SituParams) {
        self.try_glu(gate, up, Some(act)).unwrap_or_else(|e| fatal("situ_glu", e))
    }

    fn attn_res_mix(&self, query: &[f32], eps: f32, cands: &[&[f32]], out: &mut [f32]) {
        // The kernel keeps one weight per candidate in registers: at most 32 of them.
        if cands.is_empty() || cands.len() > 32 || query.is_empty() {
            return self.cpu.attn_res_mix(query, eps, cands, out);
        }
        self.try_attn_res_mix(query, eps, cands, out).unwrap_or_else(|e| fatal("attn_res_mix", e))
    }

    fn kda_conv(&self, x: &mut [f32], spans: &[SeqSpan], frames: &mut [&mut [f32]], taps: &[f32], kernel: usize) {
        // The kernel's window lives in registers: kernels of at most 8 taps.
        if kernel == 0 || kernel > 8 || taps.len() < kernel || spans.is_empty() {
            return self.cpu.kda_conv(x, spans, frames, taps, kernel);
        }
        self.try_kda_conv(x, spans, frames, taps, kernel).unwrap_or_else(|e| fatal("kda_conv", e))
    }

    fn kda_recurrence(
        &self,
        p: &KdaParams<'_>,
        x: &KdaInputs<'_>,
        spans: &[SeqSpan],
        slots: &mut [KdaSlot<'_>],
        out: &mut [f32],
    ) {
        // One token a sequence: the decode kernel (kpl); packed spans of any length: the chunked
        // kernel (Triton). Speculative verifies (per-token snapshots) stay on the CPU backend.
        let (h, n) = (p.heads, p.head_dim);
        let mut at = 0;
        let packed = !spans.is_empty()
            && spans.iter().all(|s| {
                let ok = s.start == at;
                at += s.len;
                ok
            });
        let plain = packed
            && slots.len() == spans.len()
            && slots.iter().all(|s| s.state.len() >= h * n * n && s.after_token.is_empty());
        if plain && n <= 256 && spans.iter().all(|s| s.len == 1) {
            return self.try_kda_decode(p, x, slots, out).unwrap_or_else(|e| fatal("kda_recurrence", e));
        }
        if plain && self.has("triton_kda_chunk_prefill") {
            return self.try_kda_prefill(p, x, spans, slots, out).unwrap_or_else(|e| fatal("kda_recurrence", e));
        }
        self.cpu.kda_recurrence(p, x, spans, slots, out)
    }

    fn gated_rms_norm(&self, o: &[f32], gate: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        self.try_gated_rms_norm(o, gate, w, eps, out).unwrap_or_else(|e| fatal("gated_rms_norm", e))
    }

    fn mla_absorb(
        &self,
        w_kv: &Matrix<'_>,
        heads: usize,
        nope: usize,
        v_dim: usize,
        tokens: usize,
        q: &[f32],
        out: &mut [f32],
    ) {
        self.cpu.mla_absorb(w_kv, heads, nope, v_dim, tokens, q, out)
    }

    fn mla_lift(
        &self,
        w_kv: &Matrix<'_>,
        heads: usize,
        nope: usize,
        v_dim: usize,
        tokens: usize,
        ctx: &[f32],
        out: &mut [f32],
    ) {
        self.cpu.mla_lift(w_kv, heads, nope, v_dim, tokens, ctx, out)
    }

    fn mla_attention(
        &self,
        q: &[f32],
        heads: usize,
        rank: usize,
        scale: f32,
        rows: &[(usize, usize)],
        caches: &[PagedRows<'_>],
        selected: Option<&[Selection]>,
        ctx: &mut [f32],
        mut lse: Option<&mut [f32]>,
    ) {
        // The decode kernel attends every held position; indexer selections stay on the CPU.
        if selected.is_none() {
            match self.try_mla_attention(q, heads, rank, scale, rows, caches, ctx, lse.as_deref_mut()) {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => fatal("mla_attention", e),
            }
        }
        self.cpu.mla_attention(q, heads, rank, scale, rows, caches, selected, ctx, lse)
    }

    fn attention_merge(&self, parts: &[&[f32]], lses: &[&[f32]], width: usize, out: &mut [f32]) {
        match self.try_attention_merge(parts, lses, width, out) {
            Ok(true) => {}
            Ok(false) => self.cpu.attention_merge(parts, lses, width, out),
            Err(e) => fatal("attention_merge", e),
        }
    }

    fn indexer_topk(
        &self,
        q: &[f32],
        w: &[f32],
        heads: usize,
        scale: f32,
        topk: usize,
        rows: &[(usize, usize)],
        keys: &[PagedRows<'_>],
    ) -> Vec<Selection> {
        match self.try_indexer_topk(q, w, heads, scale, topk, rows, keys) {
            Ok(Some(selections)) => selections,
            Ok(None) => self.cpu.indexer_topk(q, w, heads, scale, topk, rows, keys),
            Err(e) => fatal("indexer_topk", e),
        }
    }

    fn moe_route(&self, logits: &[f32], tokens: usize, p: &RouterParams<'_>) -> Routing {
        // The kernel's per-token selection lives in shared memory: at most 1024 experts.
        let e = p.bias.len();
        if e == 0 || e > 1024 || p.top_k == 0 || p.top_k > e || tokens == 0 {
            return self.cpu.moe_route(logits, tokens, p);
        }
        self.try_moe_route(logits, tokens, p).unwrap_or_else(|e| fatal("moe_route", e))
    }

    fn moe_experts(
        &self,
        experts: &[ExpertMatrices<'_>],
        first: usize,
        routing: &Routing,
        z: &[f32],
        spans: &[SeqSpan],
        act: SituParams,
        out: &mut [f32],
    ) {
        // The device's grouped products compute every token from its own row alone, whatever
        // its sequence: `spans` do not change them.
        match self.try_moe_experts(experts, first, routing, z, act, out) {
            Ok(true) => {}
            Ok(false) => self.cpu.moe_experts(experts, first, routing, z, spans, act, out),
            Err(e) => fatal("moe_experts", e),
        }
    }
}
