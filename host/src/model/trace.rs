//! Optional capture of intermediate tensors during a forward pass (golden tests, debugging).

use std::collections::BTreeMap;

#[derive(Clone, Debug)]
pub enum TraceTensor {
    F32 { shape: Vec<usize>, data: Vec<f32> },
    I64 { shape: Vec<usize>, data: Vec<i64> },
    U8 { shape: Vec<usize>, data: Vec<u8> },
}

/// Named tensors, named as in the goldens (`layer3.mixer_output`, `layer1.router.topk_ids`, …).
#[derive(Default, Debug)]
pub struct Trace {
    pub tensors: BTreeMap<String, TraceTensor>,
}

impl Trace {
    pub fn f32(&mut self, name: impl Into<String>, shape: &[usize], data: &[f32]) {
        self.tensors.insert(name.into(), TraceTensor::F32 { shape: shape.to_vec(), data: data.to_vec() });
    }

    pub fn i64(&mut self, name: impl Into<String>, shape: &[usize], data: Vec<i64>) {
        self.tensors.insert(name.into(), TraceTensor::I64 { shape: shape.to_vec(), data });
    }

    pub fn u8(&mut self, name: impl Into<String>, shape: &[usize], data: Vec<u8>) {
        self.tensors.insert(name.into(), TraceTensor::U8 { shape: shape.to_vec(), data });
    }

    pub fn get_u8(&self, name: &str) -> Option<&[u8]> {
        match self.tensors.get(name) {
            Some(TraceTensor::U8 { data, .. }) => Some(data),
            _ => None,
        }
    }

    pub fn get_f32(&self, name: &str) -> Option<&[f32]> {
        match self.tensors.get(name) {
            Some(TraceTensor::F32 { data, .. }) => Some(data),
            _ => None,
        }
    }

    pub fn get_i64(&self, name: &str) -> Option<&[i64]> {
        match self.tensors.get(name) {
            Some(TraceTensor::I64 { data, .. }) => Some(data),
            _ => None,
        }
    }
}
